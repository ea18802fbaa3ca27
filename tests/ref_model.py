"""Reference-side helpers: tiny randomised `Qwen3TTSForConditionalGeneration` models and their checkpoints.

Configs come from `qtts_jax.presets.model_config` (the same dicts our loader parses), in several
shapes. Import inside fixtures only: importing `qwen_tts` takes seconds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from qtts_jax import presets
from ref_codec import build_reference_codec, write_codec_checkpoint
from ref_speaker import randomize_speaker_encoder_

GENERATION_CONFIG = {
    "do_sample": True, "temperature": 0.9, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.05,
    "subtalker_dosample": True, "subtalker_temperature": 0.9, "subtalker_top_k": 50, "subtalker_top_p": 1.0,
    "max_new_tokens": 8192,
}

# Shapes exercised by the parity tests: predictor narrower than the talker (with the 2048→1024-style
# projection) and MQA in the predictor; equal widths with GQA; MQA in the talker.
SHAPES = {
    "narrow_predictor_mqa": dict(talker=(64, 128, 2, 4, 2, 16), predictor=(32, 64, 2, 4, 1, 16), text_hidden=48),
    "equal_width_gqa": dict(talker=(32, 96, 2, 4, 2, 8), predictor=(32, 64, 2, 4, 2, 8), text_hidden=24),
    "talker_mqa": dict(talker=(48, 64, 3, 4, 1, 16), predictor=(32, 48, 1, 2, 1, 16), text_hidden=32),
}


def config_dict(kind: str, size: str = "1b7", shape: str = "narrow_predictor_mqa") -> dict:
    s = SHAPES[shape]
    base = presets.tiny_config(kind, size)
    t, p = s["talker"], s["predictor"]
    talker = presets.decoder_config(*t, 3072)
    predictor = presets.decoder_config(*p, 2048)
    text_ids = {k: base[k] for k in base if k.endswith("_token_id")}
    return presets.model_config(
        size=size, kind=kind, talker=talker, predictor=predictor,
        text_vocab=base["talker_config"]["text_vocab_size"], text_hidden=s["text_hidden"], text_ids=text_ids,
    )


def build_reference_model(config: dict, seed: int = 0):
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration

    cfg = Qwen3TTSConfig(**json.loads(json.dumps(config)))
    for c in (cfg, cfg.talker_config, cfg.talker_config.code_predictor_config):
        c._attn_implementation = "eager"
    model = Qwen3TTSForConditionalGeneration(cfg).eval()
    randomize_(model, seed)
    if model.speaker_encoder is not None:  # Base: x-vectors from real audio need a working encoder
        randomize_speaker_encoder_(model.speaker_encoder, seed)
    return model


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Seeded weights with O(1) activations and well-separated logits (so greedy choices are robust)."""
    gen = torch.Generator().manual_seed(seed)
    for name, tensor in model.named_parameters():
        shape = tensor.shape
        if name.startswith("speaker_encoder"):
            continue  # randomize_speaker_encoder_ does these, with its own generator
        if "norm" in name and name.endswith("weight"):
            value = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        elif name.endswith("bias"):
            value = 0.05 * torch.randn(shape, generator=gen)
        elif "embedding" in name:
            value = torch.randn(shape, generator=gen)
        else:
            gain = 4.0 if ("codec_head" in name or "lm_head" in name) else 1.0
            value = gain * torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
        tensor.copy_(value)


def write_checkpoint(directory: Path, model, codec_model=None, seed: int = 0) -> Path:
    """A complete Hugging Face-layout checkpoint directory, as the released repos lay it out."""
    directory = Path(directory)
    model.save_pretrained(directory)
    # Spell out every field as the released file does, except the speaker-encoder block: the released
    # one has only enc_dim and sample_rate, and the reference cannot read back its own full dump.
    config = model.config.to_dict()
    config["speaker_encoder_config"] = {k: config["speaker_encoder_config"][k] for k in ("enc_dim", "sample_rate")}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
    presets.write_tiny_tokenizer(directory)
    codec = codec_model if codec_model is not None else build_reference_codec(seed=seed)
    write_codec_checkpoint(directory / "speech_tokenizer", codec)
    return directory
