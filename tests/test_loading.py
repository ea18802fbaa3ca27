"""Checkpoint loading: exact tensors, sharded files, bf16 files, the tokenizer, and clear errors."""

from __future__ import annotations

import json
import re
import shutil

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

from qtts_jax.io.checkpoint import read_safetensors
from qtts_jax.io.errors import CheckpointError
from qtts_jax.config import load_config
from qtts_jax.io.text import TextTokenizer
from qtts_jax.io.checkpoint import hf_shapes
from qtts_jax.nn import state_shapes
from qtts_jax.talker.weights import load_talker, name_table


@pytest.fixture()
def checkpoint_copy(reference_checkpoint, tmp_path):
    _, directory = reference_checkpoint("custom_voice")
    copy = tmp_path / "ckpt"
    shutil.copytree(directory, copy)
    return copy


def test_params_are_the_reference_tensors(reference_checkpoint):
    ref, directory = reference_checkpoint("custom_voice")
    cfg, _ = load_config(directory)
    talker = load_talker(directory, cfg, np.float32)
    sd = {k: v.numpy() for k, v in ref.state_dict().items()}
    q, kv, f = (cfg.talker.num_heads * cfg.talker.head_dim, cfg.talker.num_kv_heads * cfg.talker.head_dim,
                cfg.talker.intermediate_size)
    layer = "talker.model.layers.1"
    np.testing.assert_array_equal(talker.stack.layers.wqkv[1], np.concatenate(
        [sd[f"{layer}.self_attn.{x}_proj.weight"].T for x in "qkv"], axis=1))
    assert talker.stack.layers.wqkv.shape[-1] == q + 2 * kv
    np.testing.assert_array_equal(talker.stack.layers.gate_up[1][:, f:], sd[f"{layer}.mlp.up_proj.weight"].T)
    np.testing.assert_array_equal(talker.predictor.embedding[14],
                                  sd["talker.code_predictor.model.codec_embedding.14.weight"])
    np.testing.assert_array_equal(talker.predictor.heads[3], sd["talker.code_predictor.lm_head.3.weight"].T)
    np.testing.assert_array_equal(talker.predictor.proj.b, sd["talker.code_predictor.small_to_mtp_projection.bias"])


@pytest.mark.parametrize("shape", ["narrow_predictor_mqa", "equal_width_gqa"])
def test_talker_state_is_exactly_the_checkpoint(reference_checkpoint, shape):
    """The module's parameters map one to one onto the checkpoint's talker tensors through the name table: every
    parameter is filled by its tensors at their shapes, and every talker tensor fills a parameter (with and without
    the predictor's projection). The reference's predictor builds heads and tables for its own default of 32 code
    groups; those past the talker's 16 are the only ones left over."""
    _, directory = reference_checkpoint("custom_voice", "1b7", shape)
    cfg, _ = load_config(directory)
    tensors = {k: v.shape for k, v in read_safetensors(directory).items() if k.startswith("talker.")}
    talker = load_talker(directory, cfg, np.float32)
    shapes = state_shapes(talker)
    table = name_table(cfg.talker, cfg.predictor)
    assert len(shapes) == len({e.ours for e in table}) - (cfg.talker.hidden_size == cfg.predictor.hidden_size) * 2
    used = hf_shapes(table, shapes)
    assert {k: tensors.get(k) for k in used} == used
    extra = [re.fullmatch(r"talker\.code_predictor\.(lm_head|model\.codec_embedding)\.(\d+)\.weight", k)
             for k in set(tensors) - set(used)]
    assert all(m and int(m[2]) >= cfg.num_code_groups - 1 for m in extra)


def test_sharded_and_bf16_checkpoints(checkpoint_copy):
    """Shards listed by model.safetensors.index.json load like one file; bf16 tensors are read as bf16."""
    cfg, _ = load_config(checkpoint_copy)
    whole = read_safetensors(checkpoint_copy)
    names = sorted(whole)
    (checkpoint_copy / "model.safetensors").unlink()
    weight_map = {}
    for part, chunk in enumerate([names[::2], names[1::2]]):
        fname = f"model-0000{part + 1}-of-00002.safetensors"
        tensors = {n: whole[n].astype(ml_dtypes.bfloat16) if "codec_head" in n else np.ascontiguousarray(whole[n])
                   for n in chunk}
        safetensors.numpy.save_file(tensors, str(checkpoint_copy / fname))
        weight_map.update({n: fname for n in chunk})
    (checkpoint_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    talker = load_talker(checkpoint_copy, cfg, np.float32)
    expected = whole["talker.codec_head.weight"].astype(ml_dtypes.bfloat16).astype(np.float32).T
    np.testing.assert_array_equal(talker.codec_head, expected)
    np.testing.assert_array_equal(talker.text_embedding, whole["talker.model.text_embedding.weight"])


def _rewrite(directory, edit):
    path = directory / "model.safetensors"
    tensors = {k: np.array(v) for k, v in read_safetensors(directory).items()}
    edit(tensors)
    path.unlink()
    safetensors.numpy.save_file(tensors, str(path))


def test_missing_tensor_is_named(checkpoint_copy):
    _rewrite(checkpoint_copy, lambda t: t.pop("talker.model.layers.1.mlp.up_proj.weight"))
    cfg, _ = load_config(checkpoint_copy)
    with pytest.raises(CheckpointError, match=r"talker\.model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_talker(checkpoint_copy, cfg, np.float32)


def test_misshaped_tensor_names_both_shapes(checkpoint_copy):
    def shrink(t):
        t["talker.codec_head.weight"] = t["talker.codec_head.weight"][:100]

    _rewrite(checkpoint_copy, shrink)
    cfg, _ = load_config(checkpoint_copy)
    with pytest.raises(CheckpointError, match=r"talker\.codec_head\.weight.*\(100, 64\).*\(3072, 64\)"):
        load_talker(checkpoint_copy, cfg, np.float32)


def test_misshaped_part_of_a_fused_projection_is_named(checkpoint_copy):
    """q, k and v fill one matrix of ours: a k_proj of the wrong size is reported by its own name and shape, not
    absorbed into the others' columns."""
    name = "talker.code_predictor.model.layers.0.self_attn.k_proj.weight"

    def widen(t):
        t[name] = np.concatenate([t[name], t[name][:8]])

    _rewrite(checkpoint_copy, widen)
    cfg, _ = load_config(checkpoint_copy)
    kv, h = cfg.predictor.num_kv_heads * cfg.predictor.head_dim, cfg.predictor.hidden_size
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}.*\({kv + 8}, {h}\).*\({kv}, {h}\)"):
        load_talker(checkpoint_copy, cfg, np.float32)


def test_truncated_weights_file(checkpoint_copy):
    path = checkpoint_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="truncated"):
        read_safetensors(checkpoint_copy)


@pytest.mark.parametrize(
    "remove,message",
    [
        ("config.json", "config.json"),
        ("model.safetensors", "model.safetensors"),
        ("speech_tokenizer/config.json", "speech_tokenizer"),
        ("speech_tokenizer/model.safetensors", "speech_tokenizer"),
        ("merges.txt", "merges.txt"),
    ],
)
def test_missing_file_is_named(checkpoint_copy, remove, message):
    from qtts_jax.model import load_model

    (checkpoint_copy / remove).unlink()
    with pytest.raises(CheckpointError, match=message):
        load_model(checkpoint_copy)


def test_config_without_a_required_key(checkpoint_copy):
    path = checkpoint_copy / "config.json"
    cfg = json.loads(path.read_text())
    del cfg["talker_config"]["codec_eos_token_id"]
    path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="codec_eos_token_id"):
        load_config(checkpoint_copy)


TEXTS = [
    "Hello there, it's 2026!",
    "  leading spaces and\nnew lines\r\n",
    "Ünïcödé, 中文字符, emoji 🎉 and numbers 12345.",
    "<|im_start|>assistant\nspecial tokens inside<|im_end|>\n",
    "assistant assistants assistant's",
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_reference_processor(reference_checkpoint, tmp_path, text):
    """vocab.json/merges.txt path and the tokenizer.json path both equal Qwen2TokenizerFast."""
    from transformers import AutoTokenizer

    _, directory = reference_checkpoint("custom_voice")
    hf = AutoTokenizer.from_pretrained(directory)
    expected = hf(text)["input_ids"]
    assert TextTokenizer.from_directory(directory).encode(text) == expected
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    assert TextTokenizer.from_directory(tmp_path).encode(text) == expected


def test_added_token_with_unexpected_id(checkpoint_copy):
    path = checkpoint_copy / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    first = min(cfg["added_tokens_decoder"], key=int)
    cfg["added_tokens_decoder"][str(int(first) + 1000)] = cfg["added_tokens_decoder"].pop(first)
    path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="should have id"):
        TextTokenizer.from_directory(checkpoint_copy)
