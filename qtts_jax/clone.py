"""Voice cloning for Base checkpoints: reference audio -> `VoicePrompt` (x-vector, and codes for ICL).

What the reference wrapper's ``create_voice_clone_prompt`` computes: the speaker encoder's x-vector of
the 24 kHz audio, and (ICL mode) the speech tokenizer's codes of the same audio plus its transcript.
Both encoders are JAX ports (`qtts_jax.speaker`, `qtts_jax.codec.encoder`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import jax
import numpy as np

from qtts_jax import nn
from qtts_jax.io.checkpoint import read_safetensors
from qtts_jax.io.errors import CheckpointError
from qtts_jax.codec import encoder as codec_encoder
from qtts_jax.codec.config import SAMPLE_RATE, CodecConfig
from qtts_jax.codec.encoder import CodecEncoder
from qtts_jax.codec.encoder_weights import load_codec_encoder, random_codec_encoder
from qtts_jax.config import read_json
from qtts_jax.io.reference_audio import ReferenceAudio
from qtts_jax.request import RequestError, VoicePrompt
from qtts_jax.speaker.config import SpeakerEncoderConfig
from qtts_jax.speaker.ecapa import SpeakerEncoder, bucket_samples, min_samples, speaker_embedding
from qtts_jax.speaker.weights import load_speaker_encoder, random_speaker_encoder


@dataclasses.dataclass
class VoiceEncoders:
    """The speaker encoder and the speech tokenizer's encoder (`nnx.Module`s), and their states as the plain
    pytrees their jitted forwards take (split once, here)."""

    speaker_cfg: SpeakerEncoderConfig
    speaker: SpeakerEncoder
    codec_cfg: CodecConfig
    codec_encoder: CodecEncoder
    speaker_params: dict = dataclasses.field(init=False)
    codec_encoder_params: dict = dataclasses.field(init=False)

    def __post_init__(self):
        self.speaker_params = nn.split(self.speaker)[1]
        self.codec_encoder_params = nn.split(self.codec_encoder)[1]

    @classmethod
    def load(cls, directory: Path, codec_cfg: CodecConfig) -> "VoiceEncoders":
        """From a Base checkpoint: ``speaker_encoder.*`` in model.safetensors, ``encoder.*`` in
        speech_tokenizer/model.safetensors."""
        directory = Path(directory)
        if codec_cfg.encoder is None:
            raise CheckpointError(f"{directory / 'speech_tokenizer/config.json'} has no encoder_config, "
                                  "which a Base model needs to clone voices")
        spk_cfg = SpeakerEncoderConfig.from_dict(read_json(directory / "config.json").get("speaker_encoder_config") or {})
        speaker = load_speaker_encoder(read_safetensors(directory, "model"), spk_cfg)
        return cls(spk_cfg, speaker, codec_cfg, load_codec_encoder(directory / "speech_tokenizer", codec_cfg))

    @classmethod
    def random(cls, enc_dim: int, codec_cfg: CodecConfig, seed: int, speaker_cfg: SpeakerEncoderConfig | None = None):
        """Random weights (presets, benchmarks); ``speaker_cfg`` defaults to the released architecture."""
        spk_cfg = dataclasses.replace(speaker_cfg or SpeakerEncoderConfig(), enc_dim=enc_dim)
        return cls(spk_cfg, random_speaker_encoder(spk_cfg, seed), codec_cfg, random_codec_encoder(codec_cfg, seed))

    def clone(self, audio: ReferenceAudio, ref_text: str | None = None, xvector_only: bool = False,
              trailing_silence_s: float = 0.0) -> VoicePrompt:
        """ICL (x-vector + codes + transcript) when a transcript is given, else x-vector only.

        ``trailing_silence_s`` appends silence to the audio before it is encoded into codes: the model then
        continues from a pause rather than mid-word, which stops the reference's last phonemes from
        bleeding into the start of every output (the reference appends nothing; 0 matches it exactly).
        """
        wav = audio.samples
        if len(wav) < min_samples(self.speaker_cfg):
            raise RequestError("audio", f"is too short for the speaker encoder ({len(wav)} samples)")
        xvector = speaker_embedding(self.speaker_params, self.speaker_cfg, wav)
        text = (ref_text or "").strip()
        if xvector_only or not text:
            return VoicePrompt(xvector=xvector)
        if trailing_silence_s > 0:
            wav = np.concatenate([wav, np.zeros(round(trailing_silence_s * SAMPLE_RATE), np.float32)])
        codes = codec_encoder.encode(self.codec_encoder_params, self.codec_cfg, wav)
        return VoicePrompt(xvector=xvector, ref_codes=codes, ref_text=text)

    def warmup(self, max_seconds: float, trailing_silence_s: float = 0.0) -> None:
        """Compile both encoders for every length bucket a recording of up to ``max_seconds`` can fall in,
        so that registering a voice never waits for a compilation (seconds on a GPU, per bucket)."""
        rng = np.random.default_rng(0)
        longest = int(max_seconds * SAMPLE_RATE)
        n = min_samples(self.speaker_cfg)
        while True:
            speaker_embedding(self.speaker_params, self.speaker_cfg, 0.1 * rng.standard_normal(n).astype(np.float32))
            if bucket_samples(n) >= longest:
                break
            n = bucket_samples(n) + 1
        frame = self.codec_cfg.encoder.frame_size
        frames, most = 1, -(-int((max_seconds + trailing_silence_s) * SAMPLE_RATE) // frame)
        while True:
            codec_encoder.encode(self.codec_encoder_params, self.codec_cfg, np.zeros(frames * frame, np.float32))
            if frames >= most:
                break
            frames *= 2

    def fingerprint(self) -> str:
        """Identifies these weights: a voice made by other encoders would sound different."""
        digest = hashlib.sha256()
        for leaf in jax.tree.leaves((self.speaker_params, self.codec_encoder_params)):
            a = np.asarray(leaf)
            digest.update(str(a.shape).encode() + a.reshape(-1)[:256].tobytes())
        return digest.hexdigest()[:16]
