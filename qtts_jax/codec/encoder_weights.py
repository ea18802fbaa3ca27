"""Loading the 12 Hz tokenizer's Mimi encoder from ``speech_tokenizer/model.safetensors`` (names ``encoder.*``).

`CodecEncoder`'s state paths (channels-last convs as (k, in, out), linears as (in, out)):

    seanet       conv_in {w, b}; stages (per stride 0, 1, ...): {blocks (0, 1, ...): {conv1, conv2}, down {w, b}};
                 conv_out
    transformer  layers: q, k, v, o, fc1, fc2, attn_norm / mlp_norm {scale, bias}, attn_scale, mlp_scale,
                 every leaf stacked on a leading layer axis
    downsample   w (stride-2 conv, no bias)
    quantizer    semantic_proj / acoustic_proj [hidden, codebook_dim]; codebooks [Q, V, codebook_dim]

Only the ``encoder_valid_num_quantizers`` codebooks the tokenizer keeps are read (semantic first): the
RVQ is sequential, so the codes of the first 16 do not depend on the 16 after them. The codebooks' raw sums
and usages (and the RVQ projections as 1x1 convs) land under ``raw/`` and become ``quantizer/*`` (`_finish`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from qtts_jax.io.checkpoint import AS_IS, CONV, LINEAR, Entry, load_module, load_table, read_safetensors
from qtts_jax.codec.config import CodecConfig
from qtts_jax.codec.encoder import CodecEncoder
from qtts_jax.codec.weights import CODEBOOK_EPS, NameTable, attention_rows, layer_scale_rows

_RVQ = {"semantic": "encoder.quantizer.semantic_residual_vector_quantizer",
        "acoustic": "encoder.quantizer.acoustic_residual_vector_quantizer"}


def codec_encoder_table(cfg: CodecConfig) -> tuple[list[Entry], dict[str, tuple[int, ...]]]:
    """The encoder's name table and our shape for every leaf (codebooks still raw sums and usages)."""
    e = cfg.encoder
    if e is None:
        raise ValueError("this speech tokenizer config has no encoder_config")
    t = NameTable()
    # SEANet: HF numbers every module of one flat list, the parameter-free ELUs included.
    t.conv("encoder.encoder.layers.0.conv", "seanet/conv_in", e.kernel_size, 1, e.num_filters)
    index, width = 1, e.num_filters
    for s, ratio in enumerate(reversed(e.upsampling_ratios)):
        for j in range(e.num_residual_layers):
            hf, ours, hidden = f"encoder.encoder.layers.{index}.block", f"seanet/stages/{s}/blocks/{j}", width // e.compress
            t.conv(f"{hf}.1.conv", f"{ours}/conv1", e.residual_kernel_size, width, hidden)
            t.conv(f"{hf}.3.conv", f"{ours}/conv2", 1, hidden, width)
            index += 1
        t.conv(f"encoder.encoder.layers.{index + 1}.conv", f"seanet/stages/{s}/down", 2 * ratio, width, 2 * width)
        index, width = index + 2, 2 * width
    t.conv(f"encoder.encoder.layers.{index + 1}.conv", "seanet/conv_out", e.last_kernel_size, width, e.hidden_size)

    h, L = e.hidden_size, e.num_hidden_layers
    q_dim, kv_dim = e.num_attention_heads * e.head_dim, e.num_key_value_heads * e.head_dim
    for hf, ours, shape, layout in [
        *attention_rows(h, q_dim, kv_dim),
        ("mlp.fc1.weight", "fc1", (h, e.intermediate_size), LINEAR),
        ("mlp.fc2.weight", "fc2", (e.intermediate_size, h), LINEAR),
        ("input_layernorm.weight", "attn_norm/scale", (h,), AS_IS),
        ("input_layernorm.bias", "attn_norm/bias", (h,), AS_IS),
        ("post_attention_layernorm.weight", "mlp_norm/scale", (h,), AS_IS),
        ("post_attention_layernorm.bias", "mlp_norm/bias", (h,), AS_IS),
        *layer_scale_rows(h),
    ]:
        t.add(f"encoder.encoder_transformer.layers.{{i}}.{hf}", f"transformer/layers/{ours}", (L, *shape), layout)
    t.add("encoder.downsample.conv.weight", "downsample/w", (e.downsample_kernel, h, h), CONV)

    counts = {"semantic": e.num_semantic_quantizers,
              "acoustic": cfg.encoder_valid_num_quantizers - e.num_semantic_quantizers}
    d, v = e.codebook_dim, e.codebook_size
    for name, hf in _RVQ.items():
        # MimiResidualVectorQuantizer has an input projection only when the widths differ.
        if d != h:
            t.add(f"{hf}.input_proj.weight", f"raw/{name}_proj", (1, h, d), CONV)
        t.add(f"{hf}.layers.{{i}}.codebook.embed_sum", f"raw/{name}_sum", (counts[name], v, d))
        t.add(f"{hf}.layers.{{i}}.codebook.cluster_usage", f"raw/{name}_usage", (counts[name], v))
    return t.entries, t.shapes


def load_codec_encoder(directory: Path, cfg: CodecConfig, dtype=np.float32) -> CodecEncoder:
    """`CodecEncoder` with the weights of ``directory/model.safetensors`` (the ``speech_tokenizer`` folder)."""
    tensors = read_safetensors(Path(directory), "model")
    entries, shapes = codec_encoder_table(cfg)
    flat = load_table(tensors, entries, shapes, np.float32, f"speech tokenizer encoder ({directory})")
    return _finish(flat, cfg, dtype)


def _finish(flat: dict, cfg: CodecConfig, dtype) -> CodecEncoder:
    """The module, its ``raw/`` leaves turned into ``quantizer/``'s: codebooks = embed_sum / clamp(cluster_usage,
    eps), semantic first; 1x1 projections as matrices (the identity where Mimi has none)."""
    raw = {k.removeprefix("raw/"): flat[k] for k in flat if k.startswith("raw/")}
    sums = np.concatenate([raw["semantic_sum"], raw["acoustic_sum"]])
    usage = np.concatenate([raw["semantic_usage"], raw["acoustic_usage"]])
    eye = np.eye(cfg.encoder.hidden_size, dtype=np.float32)
    return load_module(lambda: CodecEncoder(cfg, dtype), {
        **{k: v for k, v in flat.items() if not k.startswith("raw/")},
        "quantizer/semantic_proj": raw["semantic_proj"][0] if "semantic_proj" in raw else eye,
        "quantizer/acoustic_proj": raw["acoustic_proj"][0] if "acoustic_proj" in raw else eye,
        "quantizer/codebooks": sums / np.maximum(usage, CODEBOOK_EPS)[..., None],
    })


def random_codec_encoder(cfg: CodecConfig, seed: int, dtype=np.float32) -> CodecEncoder:
    """`CodecEncoder` with seeded random weights at ``cfg``'s shapes (benchmarks): matrices N(0, 1/fan_in), norms ~1,
    layer scales ~0.4, codebooks N(0, 1) over usages in [0.5, 2], as tests/ref_codec.py randomises."""
    rng = np.random.default_rng(seed)
    entries, shapes = codec_encoder_table(cfg)
    layouts = {e.ours: e.layout for e in entries}
    flat = {}
    for path, shape in shapes.items():
        leaf = path.rsplit("/", 1)[-1]
        if leaf.endswith("usage"):
            value = rng.uniform(0.5, 2.0, shape)
        elif leaf.endswith("sum"):
            value = rng.standard_normal(shape)
        elif leaf.endswith("_scale"):
            value = rng.uniform(0.2, 0.6, shape)
        elif leaf == "scale":
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif leaf in ("b", "bias"):
            value = 0.05 * rng.standard_normal(shape)
        else:  # CONV (..., k, in, out): fan-in k * in; LINEAR (..., in, out): in
            fan_in = shape[-3] * shape[-2] if layouts[path] is CONV else shape[-2]
            value = rng.standard_normal(shape) / np.sqrt(fan_in)
        flat[path] = value.astype(np.float32)
    return _finish(flat, cfg, dtype)
