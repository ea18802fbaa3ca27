"""The export is a CustomVoice checkpoint that both loaders read: ours serves the new speaker, and the reference
`qwen_tts` model loaded from the same directory generates the same greedy codes."""

from __future__ import annotations

import json

import jax
import numpy as np

from qtts_jax import nn
from qtts_jax.io.checkpoint import read_safetensors
from qtts_jax.finetune.export import SPEAKER_ROW, export
from qtts_jax.model import load_model
from qtts_jax.request import Request

FRAMES = 6
TEXT = "hello there"


def perturbed(model, seed=0):
    """Stand-in for a trained talker: every weight moved, so the test sees which ones the export wrote."""
    leaves, treedef = jax.tree.flatten(model.params)
    rng = np.random.default_rng(seed)
    moved = [np.asarray(a) + 0.01 * rng.standard_normal(a.shape).astype(np.float32) for a in leaves]
    return nn.merge(model.graph, jax.tree.unflatten(treedef, moved))


def test_export_from_a_base_checkpoint_serves_the_speaker_as_the_reference_does(reference_checkpoint,
                                                                                  checkpoint_model, tmp_path):
    import torch
    from qwen_tts import Qwen3TTSModel
    from transformers import AutoTokenizer

    _, source = reference_checkpoint("base")
    base = checkpoint_model("base")
    talker = perturbed(base)
    xvector = np.random.default_rng(1).standard_normal(base.cfg.talker.hidden_size).astype(np.float32)
    out = export(talker, source, "Nova", xvector, tmp_path / "model")

    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temporary left
    config = json.loads((out / "config.json").read_text())
    assert config["tts_model_type"] == "custom_voice"
    assert config["talker_config"]["spk_id"] == {"nova": SPEAKER_ROW}
    assert config["talker_config"]["spk_is_dialect"] == {"nova": False}
    tensors = read_safetensors(out, "model")
    assert not any(k.startswith("speaker_encoder.") for k in tensors)
    np.testing.assert_array_equal(tensors["talker.model.codec_embedding.weight"][SPEAKER_ROW], xvector)

    ours = load_model(out)
    expected = jax.tree.map(np.array, nn.flat_params(talker))
    expected["codec_embedding"][SPEAKER_ROW] = xvector
    loaded = nn.flat_params(ours.talker)
    assert loaded.keys() == expected.keys()  # every state path round-trips through the name table
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, loaded), expected)
    req = Request(text=TEXT, speaker="Nova", greedy=True, subtalker_greedy=True, max_frames=FRAMES)
    (got,) = ours.generate(req)

    ref = Qwen3TTSModel.from_pretrained(str(out)).model
    tok = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok(f"<|im_start|>assistant\n{TEXT}<|im_end|>\n<|im_start|>assistant\n")["input_ids"]])
    codes, _ = ref.generate(input_ids=[ids], languages=["auto"], speakers=["Nova"], non_streaming_mode=True,
                            max_new_tokens=FRAMES + 1, do_sample=False, subtalker_dosample=False)
    np.testing.assert_array_equal(got.codes, codes[0].numpy())


def test_export_from_a_preset_loads_back_with_the_same_codec(tiny_base_model, tmp_path):
    m = tiny_base_model
    xvector = np.ones(m.cfg.talker.hidden_size, np.float32)
    out = export(m.talker, "tiny-random-base", "nova", xvector, tmp_path / "model", (m.codec, m.codec_cfg))
    again = export(m.talker, "tiny-random-base", "nova", xvector, tmp_path / "model", (m.codec, m.codec_cfg))
    assert again == out and sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # replaced in place
    loaded = load_model(out)
    assert loaded.cfg.model_type == "custom_voice" and set(loaded.cfg.speakers) == {"nova"}
    jax.tree.map(np.testing.assert_array_equal, loaded.codec_params, m.codec_params)
    np.testing.assert_array_equal(loaded.params["stack"]["layers"]["wqkv"], m.params["stack"]["layers"]["wqkv"])
