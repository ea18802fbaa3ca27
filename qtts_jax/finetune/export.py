"""Export a fine-tuned talker as a Hugging Face-layout CustomVoice checkpoint, as the official recipe writes it.

config.json: ``tts_model_type = "custom_voice"``, ``talker_config.spk_id = {name: 3000}``,
``spk_is_dialect = {name: false}``. model.safetensors: the trained `Talker` module's state (code predictor
included) written through the same name table that loads it (`weights.name_table`, inverted by
`checkpoint.table_tensors`, so every name round-trips), in the source's dtypes; the speaker's x-vector written
into row 3000 of the talker's codec embedding (the row ``spk_id`` names, so choosing the speaker feeds exactly
the embedding the training fed in the speaker slot); ``speaker_encoder.*`` dropped. Everything else (speech
tokenizer, text tokenizer, generation config) comes from the source directory; a random preset is written out
in full (its speech tokenizer's decoder only: the export is a CustomVoice model, which never encodes audio), its
config marked as random weights (`model.NOISE_KEY`), so the fine-tuned model is flagged as noise too. The
directory is built under a temporary name and renamed into place, so a crash never leaves half an export.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from qtts_jax import nn, presets
from qtts_jax.io.checkpoint import read_safetensors, table_tensors, write_safetensors_file
from qtts_jax.codec.config import CodecConfig
from qtts_jax.codec.decoder import CodecDecoder
from qtts_jax.codec.weights import codec_decoder_tensors
from qtts_jax.model import NOISE_KEY, PRESETS
from qtts_jax.talker import Talker
from qtts_jax.talker.weights import name_table

SPEAKER_ROW = 3000  # the official recipe's codec id for the fine-tuned speaker
CODEC_EMBEDDING = "talker.model.codec_embedding.weight"


def export(talker: Talker, source: str | Path, speaker: str, xvector: np.ndarray, out: Path,
           codec: tuple[CodecDecoder, CodecConfig] | None = None) -> Path:
    """Write ``talker`` as a CustomVoice checkpoint to ``out`` (replacing an earlier export there).

    ``source``: the Base checkpoint directory trained from, or a preset name (then ``codec``, the model's
    (decoder module, codec config), provides its speech tokenizer)."""
    out = Path(out)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    if str(source) not in PRESETS:  # as load_model reads it: a preset's name first, else a directory
        source = Path(source)
        replaced = shutil.ignore_patterns("model.safetensors*", "config.json")  # at the top level only
        shutil.copytree(source, tmp, ignore=lambda d, names: replaced(d, names) if Path(d) == source else [])
        config = json.loads((source / "config.json").read_text())
        tensors = {k: v for k, v in read_safetensors(source, "model").items() if not k.startswith("speaker_encoder.")}
    else:
        config, codec_dict = presets.preset_configs(str(source))
        config[NOISE_KEY] = True  # trained from random weights: still noise, and `load_model` says so
        tmp.mkdir(parents=True)
        presets.write_tiny_tokenizer(tmp)
        codec_dict.pop("encoder_config", None)
        (tmp / "speech_tokenizer").mkdir()
        (tmp / "speech_tokenizer" / "config.json").write_text(json.dumps(codec_dict, indent=2))
        write_safetensors_file(tmp / "speech_tokenizer" / "model.safetensors", codec_decoder_tensors(*codec))
        tensors = {}
    trained = table_tensors(nn.flat_params(talker), name_table(talker.stack.cfg, talker.predictor.stack.cfg))
    trained[CODEC_EMBEDDING][SPEAKER_ROW] = np.asarray(xvector, np.float32)
    for name, value in trained.items():
        dtype = tensors[name].dtype if name in tensors else np.float32
        tensors[name] = value.astype(dtype)
    write_safetensors_file(tmp / "model.safetensors", tensors)
    (tmp / "config.json").write_text(json.dumps(custom_voice_config(config, speaker), indent=2, ensure_ascii=False))
    _replace(tmp, out)
    return out


def custom_voice_config(config: dict, speaker: str) -> dict:
    """The source's config.json as a single-speaker CustomVoice model. The name is stored lower-case: both
    loaders look speakers up by ``name.lower()``."""
    config = json.loads(json.dumps(config))
    config["tts_model_type"] = "custom_voice"
    talker = config.setdefault("talker_config", {})
    talker["spk_id"] = {speaker.lower(): SPEAKER_ROW}
    talker["spk_is_dialect"] = {speaker.lower(): False}
    return config


def _replace(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an earlier ``out`` is moved aside first and removed only after."""
    old = out.with_name(f"{out.name}.old{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
