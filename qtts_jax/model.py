"""`load_model` and `Model.generate`: text in, codes and 24 kHz audio out, for one or many requests."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qtts_jax import nn, presets, xla_flags
from qtts_jax.clone import VoiceEncoders
from qtts_jax.codec import decoder as codec_decoder
from qtts_jax.codec.decoder import CodecDecoder
from qtts_jax.codec.config import SAMPLE_RATE, CodecConfig
from qtts_jax.codec.weights import load_codec_decoder, random_codec_decoder
from qtts_jax.config import ModelConfig, SamplingDefaults, load_config, read_json
from qtts_jax.generate import Generator
from qtts_jax.prompt import build_prompt
from qtts_jax.io.reference_audio import AudioLimits, ReferenceAudio, load_reference_audio, prepare_reference
from qtts_jax.request import Request, RequestError, VoicePrompt
from qtts_jax.io.text import TextTokenizer
from qtts_jax.talker import Talker
from qtts_jax.talker.weights import load_talker, random_talker

log = logging.getLogger(__name__)

PRESETS = ("tiny-random", "tiny-random-base", "0.6b", "1.7b", "0.6b-base", "1.7b-base")
# A config.json key our exports add when the weights came from random ones (a model fine-tuned from a preset): its
# audio is noise too, and tools that cap noise (synth's frame cap) must know. Other loaders ignore the key.
NOISE_KEY = "qtts_jax_random_weights"


@dataclasses.dataclass
class Result:
    codes: np.ndarray  # [frames, 16] int
    audio: np.ndarray  # [samples] float32 in [-1, 1] at 24 kHz
    frames: int
    sample_rate: int = SAMPLE_RATE


class Model:
    """A loaded checkpoint (or preset): config, the talker (an `nnx.Module` with the code predictor inside), the
    speech tokenizer's decoder (`codec`, an `nnx.Module`), text tokenizer, and for Base models the voice encoders.

    The modules are split once, here: `graph` (the talker's static graph definition) and `params` (its state as a
    plain nested dict of arrays) are what every jitted program takes, and `codec_params` the decoder's state;
    `nn.merge(model.graph, model.params)` is the talker again (inside a traced function, at trace time only)."""

    def __init__(self, name, cfg, defaults, talker: Talker, codec_cfg, codec: CodecDecoder, tokenizer,
                 is_noise=False, voice_encoders: VoiceEncoders | None = None, source: str | None = None):
        self.name = name
        self.source = source  # what `load_model` was given (a directory or preset): another process loads it again
        self.cfg: ModelConfig = cfg
        self.defaults: SamplingDefaults = defaults
        self.talker = talker
        self.graph, self.params = nn.split(talker)
        self.dtype = talker.codec_embedding.dtype
        self.codec_cfg: CodecConfig = codec_cfg
        self.codec = codec
        self.codec_params = nn.split(codec)[1]
        self.tokenizer: TextTokenizer = tokenizer
        self.is_noise = is_noise
        self.voice_encoders = voice_encoders  # Base models only
        self._generator = Generator(self.graph, cfg)

    def generate(self, requests: Request | list[Request]) -> list[Result]:
        """Synthesize one request or a padded batch; each result is what the request alone would give.

        A request without `max_frames` stops at EOS or at a cap derived from its text length."""
        batch = [requests] if isinstance(requests, Request) else list(requests)
        resolved = [r.resolved(self.cfg, self.defaults) for r in batch]
        prompts = [build_prompt(self.cfg, self.tokenizer, r) for r in resolved]
        # Without an explicit max_frames, the text-length guard applies (the reference has none).
        resolved = [
            r if asked.max_frames is not None else dataclasses.replace(r, max_frames=min(r.max_frames, p.frame_cap()))
            for asked, r, p in zip(batch, resolved, prompts)
        ]
        codes = self._generator.run(self.params, prompts, resolved)
        return [self._result(r, c) for r, c in zip(resolved, codes)]

    def clone_voice(self, audio, ref_text: str | None = None, xvector_only: bool = False,
                    trailing_silence_s: float = 0.0, limits: AudioLimits = AudioLimits()) -> VoicePrompt:
        """Reference audio -> a voice for `Request(voice=...)`: ICL with a transcript, else x-vector only.

        ``audio``: a `ReferenceAudio`, a file path, file bytes, base64, or ``(samples, sample_rate)``.
        """
        if self.voice_encoders is None:
            raise RequestError("voice", f"only Base models clone voices; this is a {self.cfg.model_type} model")
        if isinstance(audio, tuple):
            audio = prepare_reference(*audio, limits=limits)
        elif not isinstance(audio, ReferenceAudio):
            audio = load_reference_audio(audio, limits)
        return self.voice_encoders.clone(audio, ref_text, xvector_only, trailing_silence_s)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """Codes [T, 16] -> float32 audio [T * 1920], chunked exactly as the reference decodes."""
        if len(codes) == 0:
            return np.zeros(0, np.float32)
        audio = codec_decoder.chunked_decode(self.codec_params, self.codec_cfg, jnp.asarray(codes)[None])
        return np.asarray(audio[0], np.float32)

    def _result(self, req: Request, codes: np.ndarray) -> Result:
        ref = req.voice.ref_codes if req.voice is not None else None
        if ref is None:
            return Result(codes=codes, audio=self.decode(codes), frames=len(codes))
        # ICL: decode with the reference frames in front for continuity, then cut the reference's share.
        full = np.concatenate([np.asarray(ref), codes])
        audio = self.decode(full)
        cut = int(len(ref) / max(len(full), 1) * len(audio))
        return Result(codes=codes, audio=audio[cut:], frames=len(codes))

    def info(self) -> dict:
        c = self.cfg
        return {
            "model": self.name,
            "kind": c.model_type,
            "size": c.model_size,
            "speakers": sorted(c.speakers),
            "languages": c.supported_languages,
            "accepts_instruct": c.accepts_instruct,
            "sample_rate": SAMPLE_RATE,
            "frame_rate_hz": SAMPLE_RATE / self.codec_cfg.decoder.samples_per_frame,
            "talker_hidden": c.talker.hidden_size,
            "talker_layers": c.talker.num_layers,
            "noise": self.is_noise,
        }


def weights_dtype(name: str) -> str:
    """The weights' dtype `name` stands for on this process's backend: "auto" is bfloat16 on a GPU (the checkpoints'
    own dtype, what capacity is measured at), float32 elsewhere (the reference's, for parity)."""
    if name != "auto":
        return name
    return "bfloat16" if jax.default_backend() == "gpu" else "float32"


def load_model(path_or_preset: str | Path, dtype=jnp.float32, seed: int = 0) -> Model:
    """A Hugging Face-layout checkpoint directory, or a random-weight preset (see `PRESETS`; the ``-base``
    ones are Base models that clone voices).

    Never touches the network: a directory is read as it is, and a missing file is an error naming it. Sets the
    XLA flags the programs are fastest under (`xla_flags`), which take effect where no backend has started yet.
    """
    xla_flags.apply()
    name = str(path_or_preset)
    cfg, defaults, codec_cfg = model_configs(path_or_preset)
    if name in PRESETS:
        return _preset(name, cfg, codec_cfg, dtype, seed)
    directory = Path(path_or_preset)
    return Model(
        name=directory.name,
        cfg=cfg,
        defaults=defaults,
        talker=load_talker(directory, cfg, dtype),
        codec_cfg=codec_cfg,
        codec=load_codec_decoder(directory / "speech_tokenizer", codec_cfg),
        tokenizer=TextTokenizer.from_directory(directory),
        is_noise=bool(read_json(directory / "config.json").get(NOISE_KEY)),
        voice_encoders=VoiceEncoders.load(directory, codec_cfg) if cfg.model_type == "base" else None,
        source=str(directory.resolve()),
    )


def model_shapes(path_or_preset: str | Path, dtype=jnp.float32) -> Model:
    """The model `load_model` gives, with the weights' shapes in place of their values and no tokenizer or voice
    encoders: all that compiling its programs needs, built in a moment with nothing on the device (the compile
    workers, `engine.compile_workers`)."""
    xla_flags.apply()
    cfg, defaults, codec_cfg = model_configs(path_or_preset)
    return Model(name=str(path_or_preset), cfg=cfg, defaults=defaults,
                 talker=nnx.eval_shape(lambda: Talker(cfg, dtype=dtype, rngs=nnx.Rngs(0))), codec_cfg=codec_cfg,
                 codec=nnx.eval_shape(lambda: CodecDecoder(codec_cfg)), tokenizer=None, source=str(path_or_preset))


def model_configs(path_or_preset: str | Path) -> tuple[ModelConfig, SamplingDefaults, CodecConfig]:
    """The model's configuration, its sampling defaults and its speech tokenizer's configuration: the one place
    they are read, from a checkpoint directory's `config.json`, `generation_config.json` and
    `speech_tokenizer/config.json`, or from a preset's tables."""
    name = str(path_or_preset)
    if name in PRESETS:
        model_dict, codec_dict = presets.preset_configs(name)
        return ModelConfig.from_dict(model_dict), SamplingDefaults(), CodecConfig.from_dict(codec_dict)
    directory = Path(path_or_preset)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a checkpoint directory nor a preset ({', '.join(PRESETS)})")
    cfg, defaults = load_config(directory)
    return cfg, defaults, CodecConfig.from_file(directory / "speech_tokenizer" / "config.json")


def _preset(name: str, cfg: ModelConfig, codec_cfg: CodecConfig, dtype, seed: int) -> Model:
    """Random weights at preset shapes; the codec stays fp32 (it is small and sets output quality)."""
    kind = "base" if name.endswith("-base") else "custom_voice"
    tokenizer = TextTokenizer(presets.tiny_tokenizer())
    # tiny: a small speaker encoder; the real shapes: the released architecture
    speaker_cfg = presets.tiny_speaker_config() if name.startswith("tiny-random") else None
    log.warning("model %s has random weights: its audio is noise", name)
    return Model(
        name=name,
        cfg=cfg,
        defaults=SamplingDefaults(),
        talker=random_talker(cfg, seed, dtype),
        codec_cfg=codec_cfg,
        codec=random_codec_decoder(codec_cfg, seed),
        tokenizer=tokenizer,
        is_noise=True,
        voice_encoders=VoiceEncoders.random(cfg.talker.hidden_size, codec_cfg, seed, speaker_cfg)
        if kind == "base" else None,
        source=name,
    )
