"""Talker and code-predictor parameters: the Hugging Face name table, loading, and random init.

Our pytree (arrays in (in, out) layout for `x @ w`; decoder layers stacked on a leading axis):

    text_embedding [text_vocab, text_hidden]      text_proj {w1, b1, w2, b2}
    codec_embedding [3072, H]                     talker {layers {...}, norm}    codec_head [H, 3072]
    cp_embedding [15, 2048, H]   (input dim is the TALKER hidden; projected after lookup)
    cp_proj {w, b}  (only when the predictor's hidden differs from the talker's)
    predictor {layers {...}, norm}                cp_heads [15, H_cp, 2048]
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from qtts_jax.checkpoint import AS_IS, LINEAR, Entry, load_table, read_safetensors, unflatten
from qtts_jax.config import DecoderConfig, ModelConfig

_LAYER = [
    ("self_attn.q_proj.weight", "wq", LINEAR),
    ("self_attn.k_proj.weight", "wk", LINEAR),
    ("self_attn.v_proj.weight", "wv", LINEAR),
    ("self_attn.o_proj.weight", "wo", LINEAR),
    ("self_attn.q_norm.weight", "q_norm", AS_IS),
    ("self_attn.k_norm.weight", "k_norm", AS_IS),
    ("input_layernorm.weight", "ln1", AS_IS),
    ("post_attention_layernorm.weight", "ln2", AS_IS),
    ("mlp.gate_proj.weight", "gate", LINEAR),
    ("mlp.up_proj.weight", "up", LINEAR),
    ("mlp.down_proj.weight", "down", LINEAR),
]


def _stack_entries(hf_prefix: str, ours: str) -> list[Entry]:
    rows = [Entry(f"{hf_prefix}.layers.{{i}}.{hf}", f"{ours}/layers/{name}", lay) for hf, name, lay in _LAYER]
    return rows + [Entry(f"{hf_prefix}.norm.weight", f"{ours}/norm")]


NAME_TABLE: list[Entry] = [
    Entry("talker.model.text_embedding.weight", "text_embedding"),
    Entry("talker.text_projection.linear_fc1.weight", "text_proj/w1", LINEAR),
    Entry("talker.text_projection.linear_fc1.bias", "text_proj/b1"),
    Entry("talker.text_projection.linear_fc2.weight", "text_proj/w2", LINEAR),
    Entry("talker.text_projection.linear_fc2.bias", "text_proj/b2"),
    Entry("talker.model.codec_embedding.weight", "codec_embedding"),
    Entry("talker.codec_head.weight", "codec_head", LINEAR),
    Entry("talker.code_predictor.model.codec_embedding.{i}.weight", "cp_embedding"),
    Entry("talker.code_predictor.small_to_mtp_projection.weight", "cp_proj/w", LINEAR),
    Entry("talker.code_predictor.small_to_mtp_projection.bias", "cp_proj/b"),
    Entry("talker.code_predictor.lm_head.{i}.weight", "cp_heads", LINEAR),
    *_stack_entries("talker.model", "talker"),
    *_stack_entries("talker.code_predictor.model", "predictor"),
]


def _stack_shapes(prefix: str, c: DecoderConfig) -> dict[str, tuple[int, ...]]:
    n, h, d = c.num_layers, c.hidden_size, c.head_dim
    return {
        f"{prefix}/layers/wq": (n, h, c.num_heads * d),
        f"{prefix}/layers/wk": (n, h, c.num_kv_heads * d),
        f"{prefix}/layers/wv": (n, h, c.num_kv_heads * d),
        f"{prefix}/layers/wo": (n, c.num_heads * d, h),
        f"{prefix}/layers/q_norm": (n, d),
        f"{prefix}/layers/k_norm": (n, d),
        f"{prefix}/layers/ln1": (n, h),
        f"{prefix}/layers/ln2": (n, h),
        f"{prefix}/layers/gate": (n, h, c.intermediate_size),
        f"{prefix}/layers/up": (n, h, c.intermediate_size),
        f"{prefix}/layers/down": (n, c.intermediate_size, h),
        f"{prefix}/norm": (h,),
    }


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our leaf path -> shape, derived from the config alone."""
    h, hc = cfg.talker.hidden_size, cfg.predictor.hidden_size
    groups = cfg.num_code_groups - 1
    shapes = {
        "text_embedding": (cfg.text_vocab_size, cfg.text_hidden_size),
        "text_proj/w1": (cfg.text_hidden_size, cfg.text_hidden_size),
        "text_proj/b1": (cfg.text_hidden_size,),
        "text_proj/w2": (cfg.text_hidden_size, h),
        "text_proj/b2": (h,),
        "codec_embedding": (cfg.talker.vocab_size, h),
        "codec_head": (h, cfg.talker.vocab_size),
        "cp_embedding": (groups, cfg.predictor.vocab_size, h),
        "cp_heads": (groups, hc, cfg.predictor.vocab_size),
        **_stack_shapes("talker", cfg.talker),
        **_stack_shapes("predictor", cfg.predictor),
    }
    if h != hc:
        shapes["cp_proj/w"] = (h, hc)
        shapes["cp_proj/b"] = (hc,)
    return shapes


def load_params(directory: Path, cfg: ModelConfig, dtype) -> dict:
    """Read `model.safetensors` (or its shards) of a checkpoint directory into our pytree."""
    tensors = read_safetensors(Path(directory), "model")
    tree = load_table(tensors, NAME_TABLE, param_shapes(cfg), np.float32, "model.safetensors")
    return jax.tree.map(lambda a: jnp.asarray(a, dtype), tree)


def random_params(cfg: ModelConfig, seed: int, dtype) -> dict:
    """Deterministic random weights at the config's shapes (presets and benchmarks; the output is noise).

    Matrices get N(0, 1/fan_in) so activations stay O(1) through the stacks; norm weights are 1.
    """
    shapes = param_shapes(cfg)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    flat = {}
    for key, (path, shape) in zip(keys, sorted(shapes.items())):
        leaf = path.rsplit("/", 1)[-1]
        if leaf in ("norm", "q_norm", "k_norm", "ln1", "ln2"):
            flat[path] = jnp.ones(shape, dtype)
        elif leaf.startswith("b"):
            flat[path] = jnp.zeros(shape, dtype)
        else:
            fan_in = shape[-2] if leaf not in ("text_embedding", "codec_embedding", "cp_embedding") else 1
            flat[path] = (jax.random.normal(key, shape, jnp.float32) * fan_in**-0.5).astype(dtype)
    return unflatten(flat)
