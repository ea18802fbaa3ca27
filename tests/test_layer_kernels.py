"""The fused layer kernels (interpret mode on CPU) equal their jnp references, the fused stack equals the model's own
layers, and the engine running its layers through them generates what it generates without them."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qtts_jax import nn
from qtts_jax.kernels import layer
from qtts_jax.request import Request
from qtts_jax.talker.transformer import KVCache, rope_tables
from qtts_jax.engine import Engine
from support import GREEDY, SMALL, assert_same_codes, run, run_small

TIGHT = dict(rtol=1e-5, atol=1e-5)  # fp32: the kernels and the references differ by summation order alone


def normal(rng, shape, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


@pytest.mark.parametrize("rows, width, heads, kv_heads, d, mlp", [(5, 64, 4, 2, 16, 128), (40, 128, 4, 1, 32, 256)])
def test_each_kernel_equals_its_reference(rows, width, heads, kv_heads, d, mlp):
    """Rows not a multiple of the row block (padded), a padding row aimed past the last slot, rows in any slot
    order, cache rows from 0 to the last, and masked cache rows below a row's own."""
    rng = np.random.default_rng(rows)
    layers, slots, capacity = 3, rows + 3, 48
    for at in range(layers):
        i = jnp.int32(at)
        x = normal(rng, (rows, width))
        ln, wqkv = 1 + normal(rng, (layers, width), 0.1), normal(rng, (layers, width, (heads + 2 * kv_heads) * d),
                                                                     width**-0.5)
        q_norm, k_norm = 1 + normal(rng, (layers, d), 0.1), 1 + normal(rng, (layers, d), 0.1)
        cos, sin = rope_tables(jnp.asarray(rng.integers(0, 500, rows)), d, 1e6, jnp.float32)
        heads_kw = dict(heads=heads, kv_heads=kv_heads)
        args = (x, ln, wqkv, q_norm, k_norm, cos, sin, i)
        qkv = layer.qkv_rope_ref(*args, eps=1e-6, **heads_kw)
        np.testing.assert_allclose(layer.qkv_rope(*args, eps=1e-6, interpret=True, **heads_kw), qkv, **TIGHT)

        cache = [normal(rng, (layers, slots, kv_heads, capacity, d)) for _ in range(2)]
        idx = jnp.asarray(np.r_[rng.permutation(rows - 1), slots + 4], jnp.int32)  # the last row is padding
        where = jnp.asarray(np.r_[0, capacity - 1, rng.integers(0, capacity, rows - 2)], jnp.int32)
        mask = jnp.asarray(rng.random((rows, capacity)) > 0.3).at[jnp.arange(rows), where].set(True)
        attn_args = (qkv, *cache, i, idx, where, mask)
        out, k, v = layer.attend(*attn_args, scale=d**-0.5, interpret=True, **heads_kw)
        ref_out, ref_k, ref_v = layer.attend_ref(*attn_args, scale=d**-0.5, **heads_kw)
        np.testing.assert_allclose(out[:-1], ref_out[:-1], **TIGHT)  # a padding row's output is never read
        np.testing.assert_array_equal(k, ref_k)  # written exactly where the reference writes, nowhere else
        np.testing.assert_array_equal(v, ref_v)

        wo = normal(rng, (layers, heads * d, width), (heads * d) ** -0.5)
        np.testing.assert_allclose(layer.project_residual(ref_out, wo, i, x, interpret=True),
                                   layer.project_residual_ref(ref_out, wo, i, x), **TIGHT)
        gate_up = normal(rng, (layers, width, 2 * mlp), width**-0.5)
        np.testing.assert_allclose(layer.norm_gate_up(x, ln, gate_up, i, eps=1e-6, interpret=True),
                                   layer.norm_gate_up_ref(x, ln, gate_up, i, eps=1e-6), **TIGHT)


def test_the_fused_stack_equals_the_models_layers(tiny_model):
    """The talker's stack run as `forward_rows_fused` (kernels and references alike) equals `forward_rows` for the
    same rows, positions and cache: the hidden states and every cache row written."""
    talker = nn.merge(tiny_model.graph, tiny_model.params)
    stack, cfg = talker.stack, tiny_model.cfg.talker
    rng = np.random.default_rng(0)
    rows, slots, capacity = 6, 8, 32
    shape = (cfg.num_layers, slots, cfg.num_kv_heads, capacity, cfg.head_dim)
    cache = KVCache(normal(rng, shape), normal(rng, shape))
    x = normal(rng, (rows, cfg.hidden_size))
    idx = jnp.asarray([3, 0, 7, 5, 1, slots + 2], jnp.int32)
    where = jnp.asarray([0, 9, 31, 17, 4, 2], jnp.int32)
    valid = jnp.asarray(rng.random((rows, capacity)) > 0.2).at[jnp.arange(rows), where].set(True)
    positions = where + 3
    expected_h, expected = stack.forward_rows(x, positions, cache, idx, where, valid)
    for ops in (layer.REFERENCES, layer.kernels(interpret=True)):
        h, got = stack.forward_rows_fused(x, positions, cache, idx, where, valid, ops)
        np.testing.assert_allclose(h[:-1], expected_h[:-1], **TIGHT)
        np.testing.assert_allclose(got.k, expected.k, **TIGHT)
        np.testing.assert_allclose(got.v, expected.v, **TIGHT)


def test_the_batched_code_predictor_equals_the_per_row_one(tiny_model):
    """`predict_rows` through the fused layers chooses the codes `predict` chooses row by row, greedy and sampled."""
    from qtts_jax.talker import sampling

    talker = nn.merge(tiny_model.graph, tiny_model.params)
    rng = np.random.default_rng(1)
    rows = 5
    hidden = normal(rng, (rows, tiny_model.cfg.talker.hidden_size))
    code0 = jnp.asarray(rng.integers(0, 2048, rows), jnp.int32)
    keys = jax.random.split(jax.random.PRNGKey(3), rows)
    p = sampling.SamplingParams(jnp.asarray([True, False, False, True, False]), jnp.full(rows, 0.9),
                                jnp.full(rows, 50, jnp.int32), jnp.full(rows, 1.0))
    expected = jax.vmap(lambda *a: talker.predict(*a)[0])(hidden, code0, keys, p)
    got = talker.predict_rows(hidden, code0, keys, p, sampling.choose, layer.kernels(interpret=True))
    np.testing.assert_array_equal(got, expected)


def test_engine_with_the_fused_layers_generates_the_same_codes(tiny_model):
    """Greedy and seeded requests, side by side in one engine: the same codes with the fused layers as without."""
    reqs = [Request("Four kernels a layer.", speaker="ryan", max_frames=6, **GREEDY),
            Request("Seeded beside it.", speaker="eric", seed=5, max_frames=4)]
    assert_same_codes(run_small(tiny_model, reqs, layers="pallas"), run_small(tiny_model, reqs, layers="jnp"))


def test_seeded_ends_stop_each_stream_at_a_frame_of_its_own_that_only_the_program_draws(tiny_model):
    """With `seeded_ends`, a stream ends between frame 2 and its cap, at a frame its seed and prompt decide: the
    same alone as beside others, different across prompts, and never known to the host before it happens."""
    engine = Engine(tiny_model, dataclasses.replace(SMALL, seeded_ends=True, slots=4))
    reqs = [Request(text, speaker="ryan", seed=3, max_frames=16)
            for text in ("One.", "A longer second prompt here.", "Three words now.", "And the fourth, longest of all.")]
    together = run(engine, [(0, r) for r in reqs])
    lengths = [len(stream.codes) for stream, _ in together]
    assert all(2 <= n <= 16 for n in lengths) and len(set(lengths)) > 1, lengths
    assert all(stream.job.frames_cap == 16 for stream, _ in together)  # the host still plans with the cap
    assert_same_codes(run(engine, [(0, reqs[1])]), together[1:2])


@pytest.mark.parametrize("size", ["0.6b", "1.7b"])
def test_each_kernel_lowers_for_an_nvidia_gpu_at_the_real_shapes(size):
    """Pallas lowers each kernel to Triton for CUDA here, with no GPU: an operation its Triton lowering lacks, or a
    block that is not a power of two, fails now rather than on the device. (Triton's own compile to PTX still
    happens only there: bench/layer_check.py.)"""
    from jax import export

    from qtts_jax.config import ModelConfig
    from qtts_jax.presets import preset_configs

    cfg = ModelConfig.from_dict(preset_configs(size)[0])
    lowered = []
    for stack in (cfg.talker, cfg.predictor):
        heads, kv, d, width = stack.num_heads, stack.num_kv_heads, stack.head_dim, stack.hidden_size
        s = jax.ShapeDtypeStruct
        bf16, layers, rows = jnp.bfloat16, stack.num_layers, 256
        x, i = s((rows, width), bf16), s((), jnp.int32)
        calls = [
            (partial(layer.qkv_rope, heads=heads, kv_heads=kv, eps=1e-6),
             (x, s((layers, width), bf16), s((layers, width, (heads + 2 * kv) * d), bf16), s((layers, d), bf16),
              s((layers, d), bf16), s((rows, d), bf16), s((rows, d), bf16), i)),
            (partial(layer.attend, heads=heads, kv_heads=kv, scale=d**-0.5),
             (s((rows, heads + 2 * kv, d), bf16), s((layers, rows, kv, 512, d), bf16),
              s((layers, rows, kv, 512, d), bf16), i, s((rows,), jnp.int32), s((rows,), jnp.int32),
              s((rows, 512), jnp.bool_))),
            (layer.project_residual, (s((rows, heads * d), bf16), s((layers, heads * d, width), bf16), i, x)),
            (partial(layer.norm_gate_up, eps=1e-6),
             (x, s((layers, width), bf16), s((layers, width, 2 * stack.intermediate_size), bf16), i)),
        ]
        for fn, args in calls:
            exported = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
                export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
            lowered.append("xla.gpu.triton" in exported.mlir_module())
    assert lowered and all(lowered)
