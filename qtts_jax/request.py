"""What one synthesis request asks for, and its validation against a model's config.

Validation happens here, before any device work, so every bad field is a `RequestError` that names
the field (the server turns it into an HTTP 400).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from qtts_jax.config import ModelConfig, SamplingDefaults


class RequestError(ValueError):
    """A request field that the model cannot honour; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclasses.dataclass(frozen=True)
class VoicePrompt:
    """A Base model's voice: an x-vector, plus reference codes and their transcript for ICL mode."""

    xvector: np.ndarray
    ref_codes: np.ndarray | None = None  # [T, 16]
    ref_text: str | None = None


@dataclasses.dataclass(frozen=True)
class Request:
    text: str
    speaker: str | None = None  # CustomVoice
    language: str = "auto"
    instruct: str | None = None  # VoiceDesign, CustomVoice 1.7B
    voice: VoicePrompt | None = None  # Base
    non_streaming: bool | None = None  # None: the reference wrapper's default for the model kind
    seed: int = 0
    greedy: bool | None = None  # None: sample unless generation_config says otherwise
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    subtalker_greedy: bool | None = None
    subtalker_temperature: float | None = None
    subtalker_top_k: int | None = None
    subtalker_top_p: float | None = None
    max_frames: int | None = None  # complete frames; None: generation_config's max_new_tokens - 1

    def resolved(self, cfg: ModelConfig, defaults: SamplingDefaults) -> "Request":
        """Check every field against the model and fill unset ones; raises `RequestError`."""
        if not self.text or not self.text.strip():
            raise RequestError("text", "must not be empty")
        lang = self.language.lower()
        if lang not in cfg.supported_languages:
            raise RequestError("language", f"'{self.language}' is not one of {cfg.supported_languages}")
        speaker = self.speaker
        if cfg.model_type == "custom_voice":
            if not speaker:
                raise RequestError("speaker", f"required for this model; one of {sorted(cfg.speakers)}")
            if speaker.lower() not in cfg.speakers:
                raise RequestError("speaker", f"'{speaker}' is not one of {sorted(cfg.speakers)}")
        elif speaker:
            raise RequestError("speaker", f"a {cfg.model_type} model has no named speakers")
        if self.instruct and not cfg.accepts_instruct:
            raise RequestError("instruct", f"not supported by a {cfg.model_size} {cfg.model_type} model")
        if cfg.model_type == "base":
            _check_voice(cfg, self.voice)
        elif self.voice is not None:
            raise RequestError("voice", "voice prompts are for Base models")
        non_streaming = self.non_streaming
        if non_streaming is None:  # the reference wrapper's defaults: streaming text only for voice clone
            non_streaming = cfg.model_type != "base"
        greedy = (not defaults.do_sample) if self.greedy is None else self.greedy
        sub_greedy = (not defaults.subtalker_dosample) if self.subtalker_greedy is None else self.subtalker_greedy
        out = dataclasses.replace(
            self,
            language=lang,
            instruct=self.instruct or None,
            non_streaming=non_streaming,
            greedy=greedy,
            temperature=_pick(self.temperature, defaults.temperature),
            top_k=_pick(self.top_k, defaults.top_k),
            top_p=_pick(self.top_p, defaults.top_p),
            repetition_penalty=_pick(self.repetition_penalty, defaults.repetition_penalty),
            subtalker_greedy=sub_greedy,
            subtalker_temperature=_pick(self.subtalker_temperature, defaults.subtalker_temperature),
            subtalker_top_k=_pick(self.subtalker_top_k, defaults.subtalker_top_k),
            subtalker_top_p=_pick(self.subtalker_top_p, defaults.subtalker_top_p),
            max_frames=_pick(self.max_frames, defaults.max_new_tokens - 1),
        )
        out._check_ranges()
        return out

    def _check_ranges(self) -> None:
        for name in ("temperature", "subtalker_temperature"):
            if not getattr(self, name) > 0:
                raise RequestError(name, "must be > 0")
        for name in ("top_p", "subtalker_top_p"):
            if not 0 < getattr(self, name) <= 1:
                raise RequestError(name, "must be in (0, 1]")
        for name in ("top_k", "subtalker_top_k"):
            if getattr(self, name) < 0:
                raise RequestError(name, "must be >= 0 (0 disables)")
        if not self.repetition_penalty > 0:
            raise RequestError("repetition_penalty", "must be > 0")
        if not 0 <= self.seed < 2**32:
            raise RequestError("seed", "must be in [0, 2**32)")
        if self.max_frames < 1:
            raise RequestError("max_frames", "must be >= 1")


def _pick(value, default):
    return default if value is None else value


def _check_voice(cfg: ModelConfig, voice: VoicePrompt | None) -> None:
    if voice is None:
        raise RequestError("voice", "a Base model needs a voice prompt (x-vector, optionally reference codes + text)")
    h = cfg.talker.hidden_size
    if np.shape(voice.xvector) != (h,):
        raise RequestError("voice", f"x-vector must have shape ({h},), got {np.shape(voice.xvector)}")
    if voice.ref_codes is not None:
        codes = np.asarray(voice.ref_codes)
        if codes.ndim != 2 or codes.shape[1] != cfg.num_code_groups or len(codes) == 0:
            raise RequestError("voice", f"reference codes must have shape (T>0, {cfg.num_code_groups})")
        if codes.min() < 0 or codes.max() >= cfg.predictor.vocab_size:
            raise RequestError("voice", f"reference codes must lie in [0, {cfg.predictor.vocab_size})")
        if not voice.ref_text:
            raise RequestError("voice", "ICL mode needs the reference transcript (ref_text)")
