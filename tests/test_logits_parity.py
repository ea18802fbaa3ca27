"""Talker logits (prefill and every decode step) and code-predictor logits equal the reference's in fp32.

Metric: max |ours - reference| / max |reference| over the vocabulary, per step; fp32 bound 1e-5.
Both sides get the same prompt vectors and the same code0 token at each step; the reference runs its
own `talker.forward` (which runs its code predictor inside) and `code_predictor.generate`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from qtts_jax import nn
from qtts_jax.talker import sampling
from qtts_jax.prompt import build_prompt, embed_prompt
from qtts_jax.request import Request
from qtts_jax.talker.transformer import rows_layout

FP32_BOUND = 1e-5
BF16_BOUND = 0.03  # bf16 weights and activations vs the fp32 reference (measured 7.6e-3 on this model)
STEPS = 5


def rel(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


def _prompt_vectors(model, req):
    req = req.resolved(model.cfg, model.defaults)
    p = build_prompt(model.cfg, model.tokenizer, req)
    speaker = np.zeros(model.cfg.talker.hidden_size, np.float32) if p.speaker is None else p.speaker
    x = embed_prompt(model.talker, p.text, p.codec, p.frames, p.speaker_row, speaker)
    trailing = model.talker.embed_text(jnp.asarray(np.append(p.trailing, model.cfg.text.tts_pad)))
    return x, trailing


def _pure(model, method: str, static=()):
    """A method of the talker as a jitted pure function of its state, as the engine's programs call it."""
    return jax.jit(lambda params, *args: getattr(nn.merge(model.graph, params), method)(*args), static_argnums=static)


def _t(a):
    return torch.tensor(np.asarray(a, np.float32))


@pytest.mark.parametrize("shape", ["narrow_predictor_mqa", "equal_width_gqa", "talker_mqa"])
def test_talker_and_predictor_logits_every_step(reference_checkpoint, checkpoint_model, shape):
    ref, _ = reference_checkpoint("custom_voice", "1b7", shape)
    model = checkpoint_model("custom_voice", "1b7", shape)
    params = model.params
    x, trailing = _prompt_vectors(model, Request("Parity, step by step.", speaker="ryan", non_streaming=False))
    n = x.shape[0]
    greedy = sampling.SamplingParams.make(True, 1.0, 0, 1.0)

    logits, hidden, cache = _pure(model, "prefill", static=3)(params, x, jnp.ones(n, bool), n + STEPS)
    with torch.no_grad():
        out = ref.talker(
            inputs_embeds=_t(x)[None], attention_mask=torch.ones(1, n, dtype=torch.long), use_cache=True,
            trailing_text_hidden=_t(trailing[:-1])[None], tts_pad_embed=_t(trailing[-1:])[None],
        )
    assert rel(logits, out.logits[0, -1]) < FP32_BOUND
    pkv, past_hidden = out.past_key_values, out.past_hidden
    np.testing.assert_allclose(np.asarray(hidden), past_hidden[0, 0].numpy(), rtol=0, atol=1e-5)

    predict, step = _pure(model, "predict"), _pure(model, "decode_rows")
    cache = rows_layout(type(cache)(cache.k[None], cache.v[None]))  # the engine's shared layout, one slot
    key_valid = jnp.zeros(n + STEPS, bool).at[:n].set(True)
    for k in range(STEPS):
        token = jnp.argmax(logits[:2048]).astype(jnp.int32)  # any code; the processors are tested elsewhere
        codes, cp_logits = predict(params, hidden, token, jax.random.PRNGKey(0), greedy)
        with torch.no_grad():
            e0 = ref.talker.get_input_embeddings()(torch.tensor([[int(token)]]))
            cp = ref.talker.code_predictor.generate(
                inputs_embeds=torch.cat([past_hidden, e0], dim=1), max_new_tokens=15, do_sample=False,
                output_logits=True, return_dict_in_generate=True,
            )
        np.testing.assert_array_equal(np.asarray(codes), cp.sequences[0].numpy())
        for j in range(15):
            assert rel(cp_logits[j], cp.logits[j][0]) < FP32_BOUND, (k, j)

        frame = jnp.concatenate([token[None], codes])
        x_k = model.talker.embed_codes(frame) + trailing[min(k, trailing.shape[0] - 1)]
        key_valid = key_valid.at[n + k].set(True)
        at = jnp.full(1, n + k, jnp.int32)
        logits, hidden, cache = step(params, x_k[None], cache, jnp.zeros(1, jnp.int32), at, at, key_valid[None])
        logits, hidden = logits[0], hidden[0]
        with torch.no_grad():
            out = ref.talker(
                input_ids=torch.tensor([[int(token)]]), attention_mask=torch.ones(1, n + k + 1, dtype=torch.long),
                past_key_values=pkv, past_hidden=past_hidden, use_cache=True,
                cache_position=torch.tensor([n + k]), generation_step=k,
                trailing_text_hidden=_t(trailing[:-1])[None], tts_pad_embed=_t(trailing[-1:])[None],
                subtalker_dosample=False,
            )
        np.testing.assert_array_equal(out.hidden_states[1][0].numpy(), np.asarray(frame))
        assert rel(logits, out.logits[0, -1]) < FP32_BOUND, k
        pkv, past_hidden = out.past_key_values, out.past_hidden


def test_bf16_prefill_within_stated_bound(reference_checkpoint, checkpoint_model):
    """bf16 weights/activations (fp32 softmax, norms and RoPE tables) stay within BF16_BOUND of fp32."""
    ref, _ = reference_checkpoint("custom_voice")
    model = checkpoint_model("custom_voice", dtype=jnp.bfloat16)
    x, _ = _prompt_vectors(model, Request("Half precision.", speaker="vivian"))
    n = x.shape[0]
    logits, _, _ = _pure(model, "prefill", static=3)(model.params, x, jnp.ones(n, bool), n)
    with torch.no_grad():
        fp32 = checkpoint_model("custom_voice")
        x32, _ = _prompt_vectors(fp32, Request("Half precision.", speaker="vivian"))
        out = ref.talker(inputs_embeds=_t(x32)[None], attention_mask=torch.ones(1, n, dtype=torch.long))
    err = rel(logits, out.logits[0, -1])
    assert err < BF16_BOUND, err
