"""Talker and code-predictor weights: the Hugging Face name table onto `talker.Talker`'s state paths, and loading.

The module's state (arrays in (in, out) layout for `x @ w`; decoder layers stacked on a leading axis):

    text_embedding [text_vocab, text_hidden]      text_proj {w1, b1, w2, b2}
    codec_embedding [3072, H]                     stack {layers {...}, norm}    codec_head [H, 3072]
    predictor  embedding [15, 2048, H]  (input dim is the TALKER hidden; projected after lookup)
               proj {w, b}  (only when the predictor's hidden differs from the talker's)
               stack {layers {...}, norm}         heads [15, H_cp, 2048]

A layer's q, k and v projections are one matrix of ours, [H, (heads + 2 kv_heads) * head_dim], and its gate and up
projections another, [H, 2 * intermediate]; each Hugging Face tensor keeps its own row in the table, naming the
columns it fills, so loading and export still go tensor by tensor.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from qtts_jax.io.checkpoint import AS_IS, LINEAR, Entry, Layout, load_module, load_table, read_safetensors
from qtts_jax.config import DecoderConfig, ModelConfig
from qtts_jax.talker.talker import Talker

def _layer_rows(c: DecoderConfig) -> list[tuple[str, str, Layout, tuple[int, int] | None]]:
    """One decoder layer's rows: q, k and v fill the columns of one matrix (`wqkv`), gate and up of another
    (`gate_up`), as `DecoderLayer` computes them."""
    q, kv, f = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    return [
        ("self_attn.q_proj.weight", "wqkv", LINEAR, (0, q)),
        ("self_attn.k_proj.weight", "wqkv", LINEAR, (q, q + kv)),
        ("self_attn.v_proj.weight", "wqkv", LINEAR, (q + kv, q + 2 * kv)),
        ("self_attn.o_proj.weight", "wo", LINEAR, None),
        ("self_attn.q_norm.weight", "q_norm", AS_IS, None),
        ("self_attn.k_norm.weight", "k_norm", AS_IS, None),
        ("input_layernorm.weight", "ln1", AS_IS, None),
        ("post_attention_layernorm.weight", "ln2", AS_IS, None),
        ("mlp.gate_proj.weight", "gate_up", LINEAR, (0, f)),
        ("mlp.up_proj.weight", "gate_up", LINEAR, (f, 2 * f)),
        ("mlp.down_proj.weight", "down", LINEAR, None),
    ]


def _stack_entries(c: DecoderConfig, hf_prefix: str, ours: str) -> list[Entry]:
    rows = [Entry(f"{hf_prefix}.layers.{{i}}.{hf}", f"{ours}/layers/{name}", lay, cols)
            for hf, name, lay, cols in _layer_rows(c)]
    return rows + [Entry(f"{hf_prefix}.norm.weight", f"{ours}/norm")]


def name_table(talker: DecoderConfig, predictor: DecoderConfig) -> list[Entry]:
    """Every Hugging Face tensor of the talker and code predictor, onto our state paths, for these two stacks
    (`ModelConfig.talker`, `.predictor`: the fused columns depend on their sizes)."""
    return [
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
        *_stack_entries(talker, "talker.model", "stack"),
        *_stack_entries(predictor, "talker.code_predictor.model", "predictor/stack"),
    ]


def load_talker(directory: Path, cfg: ModelConfig, dtype) -> Talker:
    """`Talker` with the weights of `model.safetensors` (or its shards) of a checkpoint directory."""
    tensors = read_safetensors(Path(directory), "model")
    table = name_table(cfg.talker, cfg.predictor)
    return load_module(lambda: Talker(cfg, dtype=dtype, rngs=nnx.Rngs(0)),
                       lambda shapes: load_table(tensors, table, shapes, np.float32, "model.safetensors"))


def random_talker(cfg: ModelConfig, seed: int, dtype=jnp.float32) -> Talker:
    """Deterministic random weights at the config's shapes (presets and benchmarks; the output is noise).

    Drawn by one jitted program: built eagerly, every parameter's draw, scaling and cast is an XLA program of its
    own to compile and launch, which cost a GPU server 20-27 s of its cold start at the 0.6B shape."""
    return nnx.jit(lambda: Talker(cfg, dtype=dtype, rngs=nnx.Rngs(seed)))()
