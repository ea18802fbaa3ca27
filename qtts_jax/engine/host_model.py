"""The host's half of a loaded model: what request checks, prompt layout and the server's answers read (config,
sampling defaults, tokenizer, name, dtype), without a weight, so a host whose core runs in another process never
loads the model or touches the device. Cloning a voice runs on the device: `clone` is the core's."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from qtts_jax.request import RequestError


@dataclasses.dataclass
class HostEncoders:
    """The voice encoders as the host sees them: their fingerprint (a voice store's key) and their warm-up, which
    the core runs."""

    fingerprint_value: str
    warm: Callable[[float, float], None] | None = None

    def fingerprint(self) -> str:
        return self.fingerprint_value

    def warmup(self, max_seconds: float, trailing_silence_s: float) -> None:
        self.warm(max_seconds, trailing_silence_s)


@dataclasses.dataclass
class HostModel:
    name: str
    cfg: Any  # config.ModelConfig
    defaults: Any  # config.SamplingDefaults
    tokenizer: Any  # io.text.TextTokenizer
    dtype: Any
    is_noise: bool
    model_info: dict
    voice_encoders: HostEncoders | None = None
    clone: Callable | None = None  # (audio, ref_text, xvector_only, trailing_silence_s) -> VoicePrompt, the core's

    @classmethod
    def of(cls, model) -> "HostModel":
        """The host half of a `Model` (in the core, to send to the host)."""
        enc = model.voice_encoders
        return cls(model.name, model.cfg, model.defaults, model.tokenizer, model.dtype, model.is_noise, model.info(),
                   None if enc is None else HostEncoders(enc.fingerprint()))

    def info(self) -> dict:
        return dict(self.model_info)

    def clone_voice(self, audio, ref_text: str | None = None, xvector_only: bool = False,
                    trailing_silence_s: float = 0.0):
        """`Model.clone_voice` of a `ReferenceAudio` (read on the host), run by the core."""
        if self.voice_encoders is None:
            raise RequestError("voice", f"only Base models clone voices; this is a {self.cfg.model_type} model")
        return self.clone(audio, ref_text, xvector_only, trailing_silence_s)
