"""The fine-tuning loss and its gradients equal the reference modules' training forward, alignment corrected.

The reference side lays the batch out as the official recipe's dataset does (text and codec channels, the
x-vector at position 6, labels on the frame positions), runs `talker(..., labels=...)` (whose causal-LM loss
shifts once, which that layout expects) and `forward_sub_talker_finetune` on the hidden states that precede
each frame, and scores the sub-talker's head k-1 against codebook k (the official loss shifts those labels
once more, so the last codebook is never trained: the correction). Ours builds the inference prompt layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.traverse_util import flatten_dict

from qtts_jax import nn
from qtts_jax.io.checkpoint import table_tensors
from qtts_jax.finetune import forward, layout
from qtts_jax.finetune.data import Example
from qtts_jax.talker.weights import name_table

TEXTS = ("hello there", "a longer sentence, with a comma")
FRAMES = (5, 9)


def official_batch(cfg, tok, examples):
    """The official dataset's collate (non-streaming, speaker slot at 6) as torch tensors."""
    import torch

    c, t = cfg.codec, cfg.text
    ids = [tok.encode(f"<|im_start|>assistant\n{e.text}<|im_end|>\n<|im_start|>assistant\n")[:-5] for e in examples]
    length = max(len(i) + len(e.codes) for i, e in zip(ids, examples)) + 8
    b = len(examples)
    text = torch.zeros((b, length), dtype=torch.long)
    codec = torch.zeros((b, length), dtype=torch.long)
    codec_ids = torch.zeros((b, length, 16), dtype=torch.long)
    text_mask, codec_emb_mask, codec_mask = (torch.zeros((b, length), dtype=torch.bool) for _ in range(3))
    attention = torch.zeros((b, length), dtype=torch.long)
    labels = torch.full((b, length), -100, dtype=torch.long)
    for r, (i, e) in enumerate(zip(ids, examples)):
        m, n = len(i), len(e.codes)
        codes = torch.tensor(e.codes, dtype=torch.long)
        text[r, :3] = torch.tensor(i[:3])
        text[r, 3:7] = t.tts_pad
        text[r, 7] = t.tts_bos
        text[r, 8:8 + m - 3] = torch.tensor(i[3:])
        text[r, 8 + m - 3] = t.tts_eos
        text[r, 8 + m - 2:8 + m + n] = t.tts_pad
        text_mask[r, :8 + m + n] = True
        codec[r, 3:8] = torch.tensor([c.nothink, c.think_bos, c.think_eos, 0, c.pad])
        codec[r, 8:8 + m - 2] = c.pad
        codec[r, 8 + m - 2] = c.bos
        codec[r, 8 + m - 1:8 + m - 1 + n] = codes[:, 0]
        codec[r, 8 + m - 1 + n] = c.eos
        labels[r, 8 + m - 1:8 + m - 1 + n] = codes[:, 0]
        labels[r, 8 + m - 1 + n] = c.eos
        codec_ids[r, 8 + m - 1:8 + m - 1 + n] = codes
        codec_emb_mask[r, 3:8 + m + n] = True
        codec_emb_mask[r, 6] = False
        codec_mask[r, 8 + m - 1:8 + m - 1 + n] = True
        attention[r, :8 + m + n] = 1
    return text, codec, codec_ids, text_mask, codec_emb_mask, codec_mask, attention, labels


def reference_loss(ref, cfg, tok, examples):
    """The official recipe's training forward with the alignment corrected; returns (loss, talker, predictor)."""
    import torch
    import torch.nn.functional as F

    batch = official_batch(cfg, tok, examples)
    text, codec, codec_ids, text_mask, codec_emb_mask, codec_mask, attention, labels = batch
    talker = ref.talker
    x = talker.text_projection(talker.model.text_embedding(text)) * text_mask[..., None]
    codec_emb = talker.model.codec_embedding(codec) * codec_emb_mask[..., None]
    codec_emb[:, 6, :] = torch.tensor(np.stack([e.xvector for e in examples]))
    x = x + codec_emb
    for i in range(1, 16):
        x = x + talker.code_predictor.get_input_embeddings()[i - 1](codec_ids[:, :, i]) * codec_mask[..., None]
    out = talker(inputs_embeds=x, attention_mask=attention, labels=labels, output_hidden_states=True)
    hidden = out.hidden_states[0][-1][:, :-1][codec_mask[:, 1:]]  # the state before each frame
    # forward_sub_talker_finetune's inputs and heads, spelled out: its loop reads the predictor config's
    # num_code_groups, which the test checkpoints (like the reference's defaults) leave at another value
    frames = codec_ids[codec_mask]
    cp = talker.code_predictor
    seq = [hidden[:, None], talker.get_input_embeddings()(frames[:, :1])]
    seq += [cp.get_input_embeddings()[i - 1](frames[:, i:i + 1]) for i in range(1, 15)]
    h = cp.model(inputs_embeds=cp.small_to_mtp_projection(torch.cat(seq, dim=1))).last_hidden_state
    logits = torch.stack([cp.lm_head[i - 1](h[:, i]) for i in range(1, 16)], dim=1)
    predictor = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), codec_ids[codec_mask][:, 1:].reshape(-1))
    return out.loss + 0.3 * predictor, out.loss, predictor


@pytest.fixture(scope="module")
def setup(reference_checkpoint, checkpoint_model):
    ref, _ = reference_checkpoint("base")
    model = checkpoint_model("base")
    rng = np.random.default_rng(7)
    h = model.cfg.talker.hidden_size
    examples = [Example(t, rng.integers(0, 2048, (n, 16)).astype(np.int32), rng.standard_normal(h).astype(np.float32))
                for t, n in zip(TEXTS, FRAMES)]
    graph, params = nnx.split(model.talker, nnx.Param)
    return ref, model, examples, graph, nnx.to_pure_dict(params)


def test_loss_and_gradients_equal_the_corrected_reference(setup):
    ref, model, examples, graph, params = setup
    ref.zero_grad()
    loss, talker, predictor = reference_loss(ref, model.cfg, model.tokenizer, examples)
    loss.backward()
    batch = layout.collate(model.cfg, model.tokenizer, examples)
    loss_and_grad = jax.jit(jax.value_and_grad(forward.losses, has_aux=True), static_argnums=(1, 2))
    (ours, parts), grads = loss_and_grad(params, graph, model.cfg, batch.arrays())
    np.testing.assert_allclose(float(parts["talker"]), talker.item(), rtol=1e-5)
    np.testing.assert_allclose(float(parts["predictor"]), predictor.item(), rtol=1e-5)
    np.testing.assert_allclose(float(ours), loss.item(), rtol=1e-5)

    torch_grads = {name: p.grad.numpy() for name, p in ref.named_parameters() if p.grad is not None}
    # ours under the torch names, through the loader's own name table (a fused leaf splits back into its tensors),
    # each compared at its own scale
    hf = table_tensors(flatten_dict(grads, sep="/"), name_table(model.cfg.talker, model.cfg.predictor))
    assert set(hf) <= set(torch_grads)
    for name, g in hf.items():
        want = torch_grads[name]
        scale = np.max(np.abs(want)) + 1e-12
        np.testing.assert_allclose(g / scale, want / scale, atol=1e-5, err_msg=name)
    # every codebook is trained: each sub-talker head has a gradient
    assert np.all(np.abs(np.asarray(grads["predictor"]["heads"])).reshape(15, -1).max(axis=1) > 0)


def test_padding_and_batching_do_not_change_the_loss(setup):
    """A batch's loss is the pooled loss of its rows: padding (longer buckets, longer neighbours, a filler row)
    changes nothing."""
    _, model, examples, graph, params = setup
    fn = jax.jit(forward.losses, static_argnums=(1, 2))
    both = fn(params, graph, model.cfg, layout.collate(model.cfg, model.tokenizer, examples, size=3).arrays())[1]
    alone = [fn(params, graph, model.cfg, layout.collate(model.cfg, model.tokenizer, [e]).arrays())[1]
             for e in examples]
    n = np.array(FRAMES)
    talker = sum(float(a["talker"]) * (k + 1) for a, k in zip(alone, n)) / np.sum(n + 1)
    predictor = sum(float(a["predictor"]) * k for a, k in zip(alone, n)) / np.sum(n)
    np.testing.assert_allclose(float(both["talker"]), talker, rtol=1e-5)
    np.testing.assert_allclose(float(both["predictor"]), predictor, rtol=1e-5)


def test_bf16_compute_keeps_fp32_gradients_and_a_close_loss(setup):
    """--compute-dtype bfloat16: the loss moves by bf16 rounding only, and the gradients stay in the fp32 masters'
    dtype (checked on the traced shapes: no second backward program is compiled)."""
    _, model, examples, graph, params = setup
    batch = layout.collate(model.cfg, model.tokenizer, examples).arrays()
    fn = jax.jit(forward.losses, static_argnums=(1, 2, 4))
    full, half = (float(fn(params, graph, model.cfg, batch, dtype)[0]) for dtype in (jnp.float32, jnp.bfloat16))
    np.testing.assert_allclose(half, full, rtol=2e-2)
    grads = jax.eval_shape(jax.grad(lambda p: forward.losses(p, graph, model.cfg, batch, jnp.bfloat16)[0]), params)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
