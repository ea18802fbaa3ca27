"""The model's parts as Flax NNX modules: their trainable state is a pytree of `nnx.Param`s, and the talker and code
predictor forwards are pure functions of it (`nn.merge` inside `jax.jit` / `jax.grad`), equal to the hot path's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qtts_jax import nn
from qtts_jax.talker import sampling

FP32_BOUND = 1e-5


def rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def test_trainable_state_and_pure_forwards(tiny_model):
    """Every weight is an `nnx.Param` (nothing else is left in the state); teacher-forced forwards of the talker and
    of the code predictor give the logits that `prefill` and `predict` give, and gradients reach every layer."""
    model = tiny_model
    graph, params, rest = nnx.split(model.talker, nnx.Param, ...)
    assert not jax.tree.leaves(rest)
    assert jax.tree.structure(nnx.to_pure_dict(params)) == jax.tree.structure(model.params)
    n = 12
    x = jax.random.normal(jax.random.PRNGKey(0), (n, model.cfg.talker.hidden_size))
    valid = jnp.arange(n) >= 3  # left padding
    greedy = sampling.SamplingParams.make(True, 1.0, 0, 1.0)

    @jax.jit
    def run(params, x, valid):
        talker = nn.merge(graph, params)
        logits, hidden = talker.forward(x, valid)
        last, last_hidden, _ = talker.prefill(x, valid, n)
        code0 = jnp.argmax(last[:2048]).astype(jnp.int32)
        codes, cp_logits = talker.predict(last_hidden, code0, jax.random.PRNGKey(1), greedy)
        forced = talker.predictor.forward(last_hidden, talker.codec_embedding[...][code0], codes[:-1])

        def loss(params):
            t = nn.merge(graph, params)
            return t.forward(x, valid)[0][-1].sum() + t.predictor.forward(last_hidden, x[-1], codes[:-1]).sum()

        return logits, last, cp_logits, forced, jax.grad(loss)(params)

    logits, last, cp_logits, forced, grads = run(params, x, valid)
    assert rel(logits[-1], last) < FP32_BOUND
    assert rel(forced, cp_logits) < FP32_BOUND
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    for layers in (grads["stack"]["layers"], grads["predictor"]["stack"]["layers"]):
        assert np.all(np.abs(np.asarray(layers["wqkv"])).reshape(layers["wqkv"].shape[0], -1).max(axis=1) > 0)


def test_every_part_of_a_base_model_is_an_nnx_module_of_params(tiny_base_model):
    """The talker (with its code predictor and both decoder stacks), the codec decoder, the codec encoder and the
    speaker encoder are `nnx.Module`s whose state is `nnx.Param`s and nothing else."""
    model = tiny_base_model
    parts = {"talker": model.talker, "code predictor": model.talker.predictor, "talker stack": model.talker.stack,
             "predictor stack": model.talker.predictor.stack, "codec decoder": model.codec,
             "codec encoder": model.voice_encoders.codec_encoder, "speaker encoder": model.voice_encoders.speaker}
    for name, part in parts.items():
        assert isinstance(part, nnx.Module), name
        _, params, rest = nnx.split(part, nnx.Param, ...)
        assert jax.tree.leaves(params) and not jax.tree.leaves(rest), name


def test_a_decoder_layer_runs_four_weight_products(tiny_model):
    """q, k, v in one product and gate, up in another: a layer multiplies by its weights four times (qkv, o, gate_up,
    down), where the checkpoint's layout would take seven, each a kernel launch at a decode step's few rows."""
    from qtts_jax.talker.transformer import rope_tables

    stack = tiny_model.talker.predictor.stack
    cfg = stack.cfg
    graph, state = nnx.split(stack.layers)
    one = jax.tree.map(lambda a: a[0], state)  # the first layer's weights
    h = jnp.ones((3, cfg.hidden_size))
    cos, sin = rope_tables(jnp.arange(3), cfg.head_dim, cfg.rope_theta, h.dtype)

    def run(one, h):
        return nnx.merge(graph, one)(cfg, h, cos, sin, (), 0, lambda q, k, v, cache, i: (q.reshape(3, -1), cache))[0]

    jaxpr = jax.make_jaxpr(run)(one, h)
    products = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(products) == 4


def test_the_code_predictors_layers_are_straight_line_code(tiny_model):
    """The code predictor's stack, run 15 times a frame, compiles without a loop over its layers, since on a GPU each
    trip of a loop is launched from the host; the talker's stack, run once a frame, stays one loop."""
    from qtts_jax.talker.transformer import KVCache

    def loops(stack) -> int:
        x = jnp.ones((2, stack.cfg.hidden_size))
        cache = KVCache.zeros(stack.cfg, 4, x.dtype)
        run = jax.jit(lambda x: stack.forward(x, jnp.arange(2), cache, jnp.int32(0), jnp.ones(4, bool)))
        return run.lower(x).as_text().count("stablehlo.while")

    assert tiny_model.talker.predictor.stack.cfg.num_layers > 1
    assert loops(tiny_model.talker.predictor.stack) == 0
    assert loops(tiny_model.talker.stack) == 1


def test_the_code_predictors_group_steps_unrolled_give_the_loops_codes_without_its_loop(tiny_model):
    """`CodePredictor.unrolled_groups` (what bench/compile.py sets to time an unrolled step) runs the 14 group steps
    as straight-line code: one loop fewer, the same codes and logits as the loop's, sampled and greedy."""
    model = tiny_model
    hidden = jax.random.normal(jax.random.PRNGKey(2), (model.cfg.talker.hidden_size,))
    code0 = jnp.int32(7)
    outs, loops = {}, {}
    for unrolled in (False, True):
        talker = nn.merge(model.graph, model.params)
        talker.predictor.unrolled_groups = unrolled
        graph = nn.split(talker)[0]

        def predict(params, greedy, graph=graph):
            p = sampling.SamplingParams.make(greedy, 0.9, 50, 0.95)
            return nn.merge(graph, params).predict(hidden, code0, jax.random.PRNGKey(5), p)

        run = jax.jit(predict, static_argnums=1)
        loops[unrolled] = run.lower(model.params, False).as_text().count("stablehlo.while")
        outs[unrolled] = [run(model.params, greedy) for greedy in (False, True)]
    assert loops[True] == loops[False] - 1
    for (codes, logits), (codes_u, logits_u) in zip(outs[False], outs[True]):
        np.testing.assert_array_equal(np.asarray(codes_u), np.asarray(codes))
        assert rel(logits_u, logits) < FP32_BOUND


def test_rows_gradient_equals_a_gathers_and_writes_each_row_once():
    """`nn.rows` is `table[ids]` with the gradient summed per id before the table is written: the same values and
    gradients as a gather's (ids repeated hundreds of times and some absent); for a bf16 table, the fp32 sum
    rounded once to bf16 (a gather's own gradient adds in bf16, 0.25 off here); and the only scatter of its
    backward is told its indices are unique, so XLA needs no atomics to add a repeated id's rows."""
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.choice([0, 3, 3, 3, 3, 7, 49], size=(6, 40)))
    table = jax.random.normal(jax.random.PRNGKey(0), (50, 8))
    w = jax.random.normal(jax.random.PRNGKey(1), (6, 40, 8))
    np.testing.assert_array_equal(nn.rows(table, ids), table[ids])
    exact = jax.grad(lambda t: jnp.sum(t[ids] * w))(table)
    ours = jax.grad(lambda t: jnp.sum(nn.rows(t, ids) * w))(table)
    np.testing.assert_allclose(ours, exact, rtol=1e-5, atol=1e-5)  # sums of up to 140 terms in another order
    assert not np.asarray(ours)[[1, 2, 48]].any()  # ids no position reads get no gradient
    half, w_half = table.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    exact = jax.grad(lambda t: jnp.sum(t[ids] * w_half.astype(jnp.float32)))(half.astype(jnp.float32))
    ours = jax.grad(lambda t: jnp.sum((nn.rows(t, ids) * w_half).astype(jnp.float32)))(half)
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(ours, np.float32), exact, rtol=2 ** -8, atol=1e-6)
    none = jax.grad(lambda t: jnp.sum(nn.rows(t, jnp.zeros((0,), jnp.int32))))(table)  # no position at all
    np.testing.assert_array_equal(none, np.zeros_like(table))
    hlo = jax.jit(jax.grad(lambda t: jnp.sum(nn.rows(t, ids)))).lower(table).as_text()
    scatters = [line for line in hlo.splitlines() if "stablehlo.scatter" in line]
    assert scatters and all("unique_indices = true" in line for line in scatters)


def test_a_batch_of_prompts_embeds_as_each_prompt_alone(tiny_model):
    """`embed_prompt` takes a batch whole (training's embedding gradients need it outside `jax.vmap`) and gives
    each row what that prompt alone gives."""
    from qtts_jax.prompt import embed_prompt

    talker, h = tiny_model.talker, tiny_model.cfg.talker.hidden_size
    rng = np.random.default_rng(0)
    text = jnp.asarray(rng.integers(-1, 100, (3, 9)))
    codec = jnp.asarray(rng.integers(-1, 50, (3, 9)))
    frames = jnp.asarray(np.where(rng.random((3, 9, 1)) < 0.5, -1, rng.integers(0, 50, (3, 9, 16))))
    speaker_row, speaker = jnp.asarray([2, 0, 8]), jnp.asarray(rng.standard_normal((3, h)), jnp.float32)
    batch = embed_prompt(talker, text, codec, frames, speaker_row, speaker)
    for b in range(3):
        alone = embed_prompt(talker, text[b], codec[b], frames[b], speaker_row[b], speaker[b])
        np.testing.assert_array_equal(batch[b], alone)
