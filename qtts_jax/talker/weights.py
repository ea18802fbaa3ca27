"""Talker and code-predictor weights: the Hugging Face name table onto `talker.Talker`'s state paths, and loading.

The module's state (arrays in (in, out) layout for `x @ w`; decoder layers stacked on a leading axis):

    text_embedding [text_vocab, text_hidden]      text_proj {w1, b1, w2, b2}
    codec_embedding [3072, H]                     stack {layers {...}, norm}    codec_head [H, 3072]
    predictor  embedding [15, 2048, H]  (input dim is the TALKER hidden; projected after lookup)
               proj {w, b}  (only when the predictor's hidden differs from the talker's)
               stack {layers {...}, norm}         heads [15, H_cp, 2048]
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from qtts_jax.io.checkpoint import AS_IS, LINEAR, Entry, load_module, load_table, read_safetensors
from qtts_jax.config import ModelConfig
from qtts_jax.talker.talker import Talker

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
    Entry("talker.code_predictor.model.codec_embedding.{i}.weight", "predictor/embedding"),
    Entry("talker.code_predictor.small_to_mtp_projection.weight", "predictor/proj/w", LINEAR),
    Entry("talker.code_predictor.small_to_mtp_projection.bias", "predictor/proj/b"),
    Entry("talker.code_predictor.lm_head.{i}.weight", "predictor/heads", LINEAR),
    *_stack_entries("talker.model", "stack"),
    *_stack_entries("talker.code_predictor.model", "predictor/stack"),
]


def load_talker(directory: Path, cfg: ModelConfig, dtype) -> Talker:
    """`Talker` with the weights of `model.safetensors` (or its shards) of a checkpoint directory."""
    tensors = read_safetensors(Path(directory), "model")
    return load_module(lambda: Talker(cfg, dtype=dtype, rngs=nnx.Rngs(0)),
                       lambda shapes: load_table(tensors, NAME_TABLE, shapes, np.float32, "model.safetensors"))


def random_talker(cfg: ModelConfig, seed: int, dtype=jnp.float32) -> Talker:
    """Deterministic random weights at the config's shapes (presets and benchmarks; the output is noise).

    Drawn by one jitted program: built eagerly, every parameter's draw, scaling and cast is an XLA program of its
    own to compile and launch, which cost a GPU server 20-27 s of its cold start at the 0.6B shape."""
    return nnx.jit(lambda: Talker(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))()
