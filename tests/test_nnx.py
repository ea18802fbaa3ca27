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
