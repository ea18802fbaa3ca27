"""Loading the 12 Hz tokenizer decoder from ``speech_tokenizer/model.safetensors`` into `CodecDecoder`.

The module's state paths (channels-last convs as (k, in, out), linears as (in, out)):

    quantizer   codebooks [Q, V, D] (already divided by cluster usage), first_proj / rest_proj [D, C]
    pre_conv    w [3, C, latent], b
    transformer input_proj, output_proj {w, b}; norm [H]; layers: every leaf stacked on a leading layer axis
    upsample    per upsampling stage (0, 1, ...): {conv {w, b}, convnext {dwconv, norm, pwconv1, pwconv2, gamma}}
    vocoder     conv_in; blocks (per rate: {snake, conv, units (0..2): {snake1, conv1, snake2, conv2}});
                snake_out; conv_out

The name table maps every HF tensor onto these paths, except the codebooks: their raw sums and usages (and
the RVQ projections as 1x1 convs) land under ``raw/`` and become ``quantizer/*`` (`_quantizer`).

SnakeBeta ``alpha``/``beta`` stay in log space, as stored; the forward pass takes their exp.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qtts_jax import nn
from qtts_jax.io.checkpoint import (AS_IS, CONV, CONV_TRANSPOSE, LINEAR, Entry, load_module, load_table, read_safetensors,
                                 table_tensors)
from qtts_jax.codec.config import RESIDUAL_DILATIONS, CodecConfig
from qtts_jax.codec.decoder import CodecDecoder

CODEBOOK_EPS = 1e-5  # EuclideanCodebook.epsilon: usage is clamped to this before dividing


class NameTable:
    """Collects name-table rows together with our leaf shapes (the decoder's table here, the encoder's in
    `encoder_weights`)."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.shapes: dict[str, tuple[int, ...]] = {}

    def add(self, hf: str, ours: str, shape: tuple[int, ...], layout=AS_IS) -> None:
        self.entries.append(Entry(hf, ours, layout))
        self.shapes[ours] = tuple(shape)

    def conv(self, hf: str, ours: str, k: int, cin: int, cout: int) -> None:
        self.add(f"{hf}.weight", f"{ours}/w", (k, cin, cout), CONV)
        self.add(f"{hf}.bias", f"{ours}/b", (cout,))

    def linear(self, hf: str, ours: str, cin: int, cout: int) -> None:
        self.add(f"{hf}.weight", f"{ours}/w", (cin, cout), LINEAR)
        self.add(f"{hf}.bias", f"{ours}/b", (cout,))

    def snake(self, hf: str, ours: str, dim: int) -> None:
        self.add(f"{hf}.alpha", f"{ours}/alpha", (dim,))
        self.add(f"{hf}.beta", f"{ours}/beta", (dim,))


def attention_rows(h: int, q_dim: int, kv_dim: int) -> list[tuple]:
    """(hf, ours, shape, layout) rows of a bias-free attention block's projections, per layer."""
    return [
        ("self_attn.q_proj.weight", "q", (h, q_dim), LINEAR),
        ("self_attn.k_proj.weight", "k", (h, kv_dim), LINEAR),
        ("self_attn.v_proj.weight", "v", (h, kv_dim), LINEAR),
        ("self_attn.o_proj.weight", "o", (q_dim, h), LINEAR),
    ]


def layer_scale_rows(h: int) -> list[tuple]:
    """The two LayerScale vectors of a transformer layer (Mimi-style, decoder and encoder alike)."""
    return [("self_attn_layer_scale.scale", "attn_scale", (h,), AS_IS), ("mlp_layer_scale.scale", "mlp_scale", (h,), AS_IS)]


def codec_decoder_table(cfg: CodecConfig) -> tuple[list[Entry], dict[str, tuple[int, ...]]]:
    """The decoder's name table and our shape for every leaf (before the codebook tables are combined)."""
    d = cfg.decoder
    t = NameTable()
    q = "decoder.quantizer"
    n_rest = d.num_quantizers - 1
    t.add(f"{q}.rvq_first.vq.layers.0._codebook.embedding_sum", "raw/first_sum", (d.codebook_size, d.rvq_dim))
    t.add(f"{q}.rvq_first.vq.layers.0._codebook.cluster_usage", "raw/first_usage", (d.codebook_size,))
    t.add(f"{q}.rvq_rest.vq.layers.{{i}}._codebook.embedding_sum", "raw/rest_sum", (n_rest, d.codebook_size, d.rvq_dim))
    t.add(f"{q}.rvq_rest.vq.layers.{{i}}._codebook.cluster_usage", "raw/rest_usage", (n_rest, d.codebook_size))
    t.add(f"{q}.rvq_first.output_proj.weight", "raw/first_proj", (1, d.rvq_dim, d.codebook_dim), CONV)
    t.add(f"{q}.rvq_rest.output_proj.weight", "raw/rest_proj", (1, d.rvq_dim, d.codebook_dim), CONV)

    t.conv("decoder.pre_conv.conv", "pre_conv", 3, d.codebook_dim, d.latent_dim)

    tr, h, L = "decoder.pre_transformer", d.hidden_size, d.num_hidden_layers
    t.linear(f"{tr}.input_proj", "transformer/input_proj", d.latent_dim, h)
    t.linear(f"{tr}.output_proj", "transformer/output_proj", h, d.latent_dim)
    t.add(f"{tr}.norm.weight", "transformer/norm", (h,))
    q_dim, kv_dim = d.num_attention_heads * d.head_dim, d.num_key_value_heads * d.head_dim
    layer = f"{tr}.layers.{{i}}"
    for hf, ours, shape, layout in [
        *attention_rows(h, q_dim, kv_dim),
        ("mlp.gate_proj.weight", "gate", (h, d.intermediate_size), LINEAR),
        ("mlp.up_proj.weight", "up", (h, d.intermediate_size), LINEAR),
        ("mlp.down_proj.weight", "down", (d.intermediate_size, h), LINEAR),
        ("input_layernorm.weight", "attn_norm", (h,), AS_IS),
        ("post_attention_layernorm.weight", "mlp_norm", (h,), AS_IS),
        *layer_scale_rows(h),
    ]:
        t.add(f"{layer}.{hf}", f"transformer/layers/{ours}", (L, *shape), layout)

    c = d.latent_dim
    for s, factor in enumerate(d.upsampling_ratios):
        hf, ours = f"decoder.upsample.{s}", f"upsample/{s}"
        t.add(f"{hf}.0.conv.weight", f"{ours}/conv/w", (factor, c, c), CONV_TRANSPOSE)
        t.add(f"{hf}.0.conv.bias", f"{ours}/conv/b", (c,))
        t.add(f"{hf}.1.dwconv.conv.weight", f"{ours}/convnext/dwconv/w", (7, 1, c), CONV)
        t.add(f"{hf}.1.dwconv.conv.bias", f"{ours}/convnext/dwconv/b", (c,))
        t.add(f"{hf}.1.norm.weight", f"{ours}/convnext/norm/scale", (c,))
        t.add(f"{hf}.1.norm.bias", f"{ours}/convnext/norm/bias", (c,))
        t.linear(f"{hf}.1.pwconv1", f"{ours}/convnext/pwconv1", c, 4 * c)
        t.linear(f"{hf}.1.pwconv2", f"{ours}/convnext/pwconv2", 4 * c, c)
        t.add(f"{hf}.1.gamma", f"{ours}/convnext/gamma", (c,))

    v = "decoder.decoder"
    t.conv(f"{v}.0.conv", "vocoder/conv_in", 7, d.latent_dim, d.decoder_dim)
    for b, rate in enumerate(d.upsample_rates):
        cin, cout = d.decoder_dim >> b, d.decoder_dim >> (b + 1)
        hf, ours = f"{v}.{b + 1}.block", f"vocoder/blocks/{b}"
        t.snake(f"{hf}.0", f"{ours}/snake", cin)
        t.add(f"{hf}.1.conv.weight", f"{ours}/conv/w", (2 * rate, cin, cout), CONV_TRANSPOSE)
        t.add(f"{hf}.1.conv.bias", f"{ours}/conv/b", (cout,))
        for u in range(len(RESIDUAL_DILATIONS)):
            hu, ou = f"{hf}.{u + 2}", f"{ours}/units/{u}"
            t.snake(f"{hu}.act1", f"{ou}/snake1", cout)
            t.conv(f"{hu}.conv1.conv", f"{ou}/conv1", 7, cout, cout)
            t.snake(f"{hu}.act2", f"{ou}/snake2", cout)
            t.conv(f"{hu}.conv2.conv", f"{ou}/conv2", 1, cout, cout)
    n_blocks = len(d.upsample_rates)
    out_dim = d.decoder_dim >> n_blocks
    t.snake(f"{v}.{n_blocks + 1}", "vocoder/snake_out", out_dim)
    t.conv(f"{v}.{n_blocks + 2}.conv", "vocoder/conv_out", 7, out_dim, 1)
    return t.entries, t.shapes


def load_codec_decoder(directory: Path, cfg: CodecConfig, dtype=np.float32) -> CodecDecoder:
    """`CodecDecoder` with the weights of ``directory/model.safetensors`` (the ``speech_tokenizer`` folder)."""
    tensors = read_safetensors(Path(directory), "model")
    entries, shapes = codec_decoder_table(cfg)
    # Read in fp32: the codebook division and everything else is done before casting to ``dtype``.
    flat = load_table(tensors, entries, shapes, np.float32, f"speech tokenizer decoder ({directory})")
    return load_module(lambda: CodecDecoder(cfg, dtype), _quantizer(flat))


def codec_decoder_tensors(decoder: CodecDecoder, cfg: CodecConfig) -> dict[str, np.ndarray]:
    """The decoder's state as ``speech_tokenizer`` tensors through the same name table, the inverse of
    `load_codec_decoder` (exports). Each codebook is written as its table over a cluster usage of 1, which loads
    back to the same table."""
    flat = nn.flat_params(decoder)
    books = np.asarray(flat.pop("quantizer/codebooks"), np.float32)
    ones = np.ones(books.shape[:2], np.float32)
    flat.update({"raw/first_sum": books[0], "raw/rest_sum": books[1:], "raw/first_usage": ones[0],
                 "raw/rest_usage": ones[1:], "raw/first_proj": np.asarray(flat.pop("quantizer/first_proj"))[None],
                 "raw/rest_proj": np.asarray(flat.pop("quantizer/rest_proj"))[None]})
    return table_tensors(flat, codec_decoder_table(cfg)[0])


def _quantizer(flat: dict) -> dict:
    """The ``raw/`` leaves replaced by ``quantizer/``'s: codebook tables = embedding_sum / clamp(cluster_usage,
    eps), codebook 0 first; the 1x1 convs as matrices."""
    raw = {k.removeprefix("raw/"): flat[k] for k in flat if k.startswith("raw/")}
    sums = np.concatenate([raw["first_sum"][None], raw["rest_sum"]])
    usage = np.concatenate([raw["first_usage"][None], raw["rest_usage"]])
    return {
        **{k: v for k, v in flat.items() if not k.startswith("raw/")},
        "quantizer/codebooks": sums / np.maximum(usage, CODEBOOK_EPS)[..., None],
        "quantizer/first_proj": raw["first_proj"][0],
        "quantizer/rest_proj": raw["rest_proj"][0],
    }


def random_codec_decoder(cfg: CodecConfig, seed: int, dtype=np.float32) -> CodecDecoder:
    """`CodecDecoder` with seeded random weights (presets, benchmarks): O(1) activations, audio mostly unclipped.

    Matrices get N(0, gain^2 / fan_in); the vocoder's residual branches and output conv get smaller gains,
    else twelve residual units compound and the clamped output saturates. Norms ~1, layer scales ~0.4.
    """
    rng = np.random.default_rng(seed)
    entries, shapes = codec_decoder_table(cfg)
    layouts = {e.ours: e.layout for e in entries}
    flat = {}
    for path, shape in shapes.items():
        leaf = path.rsplit("/", 1)[-1]
        if leaf.endswith("usage"):
            value = rng.uniform(0.5, 2.0, shape)
        elif leaf.endswith("sum"):
            value = rng.standard_normal(shape)
        elif leaf in ("alpha", "beta"):
            value = 0.3 * rng.standard_normal(shape)
        elif leaf.endswith("_scale") or leaf == "gamma":
            value = rng.uniform(0.2, 0.6, shape)
        elif leaf in ("norm", "attn_norm", "mlp_norm", "scale"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif leaf in ("b", "bias"):
            value = 0.05 * rng.standard_normal(shape)
        else:
            fan_in = int(np.prod(shape[-3:-1] if len(shape) >= 3 else shape[-2:-1]))
            if layouts[path] is CONV_TRANSPOSE and "vocoder" in path:
                fan_in //= shape[-3] // 2  # stride = k / 2 in the vocoder; upsample stages have stride = k
            elif layouts[path] is CONV_TRANSPOSE:
                fan_in //= shape[-3]
            gain = 0.3 if path.endswith("conv2/w") else 0.1 if path == "vocoder/conv_out/w" else 1.0
            value = gain * rng.standard_normal(shape) / np.sqrt(fan_in)
        flat[path] = value.astype(np.float32)
    return load_module(lambda: CodecDecoder(cfg, dtype), _quantizer(flat))
