"""Speech-tokenizer (12 Hz codec) configuration, read from ``speech_tokenizer/config.json``.

Only the fields the decoder and encoder use are kept. Every decoder field is required in the file: the
reference's decoder class defaults (hidden 1024, intermediate 3072, ...) do not match the released
checkpoints, so a field silently taken from a default would build the wrong network. The encoder is HF's
``MimiConfig``, whose defaults *are* the released encoder, so there a missing field takes its default.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Mapping

from qtts_jax.io.errors import CheckpointError

MODEL_TYPE = "qwen3_tts_tokenizer_12hz"
# The 12 Hz family's audio: 24 kHz mono in frames of 1920 samples (80 ms). `CodecConfig.from_dict` refuses a
# file with other rates, so code with no config at hand (stream timing, the server's encoders, studies)
# imports these instead of restating them.
SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 1920
# Fixed by the reference's vocoder block (three residual units per block), not read from the config.
RESIDUAL_DILATIONS = (1, 3, 9)


@dataclasses.dataclass(frozen=True)
class CodecDecoderConfig:
    """``decoder_config`` of the 12 Hz tokenizer: RVQ dequant, pre-transformer, upsampler, vocoder."""

    codebook_size: int
    codebook_dim: int  # the two RVQs work at codebook_dim // 2 and project back to codebook_dim
    num_quantizers: int
    latent_dim: int
    decoder_dim: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int
    rope_theta: float
    rms_norm_eps: float
    upsample_rates: tuple[int, ...]
    upsampling_ratios: tuple[int, ...]

    @property
    def rvq_dim(self) -> int:
        return self.codebook_dim // 2

    @property
    def samples_per_frame(self) -> int:
        return math.prod(self.upsampling_ratios) * math.prod(self.upsample_rates)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CodecDecoderConfig":
        _require(d, "decoder_config", [f.name for f in dataclasses.fields(cls) if f.name != "head_dim"])
        # These three change the network in ways this port does not implement; refuse rather than ignore.
        if d.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"decoder_config.hidden_act={d['hidden_act']!r} is not supported (only 'silu')")
        if d.get("attention_bias", False):
            raise CheckpointError("decoder_config.attention_bias=true is not supported")
        scaling = d.get("rope_scaling") or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise CheckpointError(f"decoder_config.rope_scaling={scaling!r} is not supported")
        return cls(
            codebook_size=int(d["codebook_size"]),
            codebook_dim=int(d["codebook_dim"]),
            num_quantizers=int(d["num_quantizers"]),
            latent_dim=int(d["latent_dim"]),
            decoder_dim=int(d["decoder_dim"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d["num_key_value_heads"]),
            # The reference (like HF RoPE) derives head_dim when the file has none.
            head_dim=int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]),
            sliding_window=int(d["sliding_window"]),
            rope_theta=float(d["rope_theta"]),
            rms_norm_eps=float(d["rms_norm_eps"]),
            upsample_rates=tuple(int(r) for r in d["upsample_rates"]),
            upsampling_ratios=tuple(int(r) for r in d["upsampling_ratios"]),
        )


@dataclasses.dataclass(frozen=True)
class CodecEncoderConfig:
    """``encoder_config`` of the 12 Hz tokenizer (HF ``MimiConfig``): SEANet, transformer, downsample, RVQ.

    Defaults are ``MimiConfig``'s. ``sliding_window`` is absent on purpose: transformers 4.57's Mimi
    encoder builds a plain causal mask and never applies it, so the reference attends to all past frames.
    """

    sampling_rate: int = SAMPLE_RATE
    num_filters: int = 64
    num_residual_layers: int = 1
    upsampling_ratios: tuple[int, ...] = (8, 6, 5, 4)  # SEANet applies them in reverse
    kernel_size: int = 7
    last_kernel_size: int = 3
    residual_kernel_size: int = 3
    dilation_growth_rate: int = 2
    compress: int = 2
    pad_mode: str = "constant"  # of the SEANet convs; the downsample conv always replicates
    hidden_size: int = 512
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    intermediate_size: int = 2048
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    frame_rate: float | None = None  # None: sampling_rate / frame_size, as MimiConfig derives it
    codebook_size: int = 2048
    codebook_dim: int = 256
    vector_quantization_hidden_dimension: int = 256
    num_quantizers: int = 32
    num_semantic_quantizers: int = 1

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.frame_rate is None:
            object.__setattr__(self, "frame_rate", self.sampling_rate / self.frame_size)

    @property
    def hop_length(self) -> int:
        """Samples per SEANet output step (25 Hz for the release)."""
        return math.prod(self.upsampling_ratios)

    @property
    def frame_size(self) -> int:
        """Samples per code frame: the SEANet strides times the downsample conv's stride 2."""
        return 2 * self.hop_length

    @property
    def downsample_kernel(self) -> int:
        """``MimiModel``: 2 * int(encodec_frame_rate / frame_rate), with encodec_frame_rate = ceil(sr / hop)."""
        return 2 * int(math.ceil(self.sampling_rate / self.hop_length) / self.frame_rate)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CodecEncoderConfig":
        # Refuse what this port does not implement rather than build a different network.
        for key, supported in [
            ("audio_channels", 1), ("use_causal_conv", True), ("use_conv_shortcut", False),
            ("hidden_act", "gelu"), ("attention_bias", False), ("trim_right_ratio", 1.0),
        ]:
            if d.get(key, supported) != supported:
                raise CheckpointError(f"encoder_config.{key}={d[key]!r} is not supported (only {supported!r})")
        scaling = d.get("rope_scaling") or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default":
            raise CheckpointError(f"encoder_config.rope_scaling={scaling!r} is not supported")
        values = {f.name: d[f.name] for f in dataclasses.fields(cls) if d.get(f.name) is not None}
        # save_pretrained writes MimiConfig's frame_rate as "_frame_rate".
        if "frame_rate" not in values and d.get("_frame_rate") is not None:
            values["frame_rate"] = d["_frame_rate"]
        if "upsampling_ratios" in values:
            values["upsampling_ratios"] = tuple(int(r) for r in values["upsampling_ratios"])
        if d.get("codebook_dim") is None and "codebook_dim" in d:  # MimiConfig: None means hidden_size
            values["codebook_dim"] = values.get("hidden_size", cls.hidden_size)
        cfg = cls(**values)
        if cfg.pad_mode not in ("constant", "replicate"):
            raise CheckpointError(f"encoder_config.pad_mode={cfg.pad_mode!r} is not supported")
        if cfg.codebook_dim != cfg.vector_quantization_hidden_dimension:
            raise CheckpointError(
                f"encoder_config.codebook_dim {cfg.codebook_dim} != vector_quantization_hidden_dimension "
                f"{cfg.vector_quantization_hidden_dimension}"
            )
        if cfg.downsample_kernel < 2:
            raise CheckpointError(f"encoder_config.frame_rate {cfg.frame_rate} leaves MimiModel without a downsample conv")
        return cfg


@dataclasses.dataclass(frozen=True)
class CodecConfig:
    """Top level of ``speech_tokenizer/config.json``: rates plus the decoder and (optional) encoder parts."""

    input_sample_rate: int
    output_sample_rate: int
    decode_upsample_rate: int
    decoder: CodecDecoderConfig
    encoder: CodecEncoderConfig | None = None  # None when the file has no encoder_config
    encoder_valid_num_quantizers: int = 16  # codes keep this many of the encoder's codebooks
    encode_downsample_rate: int = SAMPLES_PER_FRAME

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CodecConfig":
        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise CheckpointError(f"speech tokenizer model_type is {d['model_type']!r}, expected {MODEL_TYPE!r}")
        _require(d, "speech tokenizer config", ["input_sample_rate", "output_sample_rate", "decode_upsample_rate", "decoder_config"])
        cfg = cls(
            input_sample_rate=int(d["input_sample_rate"]),
            output_sample_rate=int(d["output_sample_rate"]),
            decode_upsample_rate=int(d["decode_upsample_rate"]),
            decoder=CodecDecoderConfig.from_dict(d["decoder_config"]),
            encoder=CodecEncoderConfig.from_dict(d["encoder_config"]) if d.get("encoder_config") is not None else None,
            encoder_valid_num_quantizers=int(d.get("encoder_valid_num_quantizers", 16)),
            encode_downsample_rate=int(d.get("encode_downsample_rate", SAMPLES_PER_FRAME)),
        )
        rates = (cfg.input_sample_rate, cfg.output_sample_rate, cfg.decode_upsample_rate)
        if rates != (SAMPLE_RATE, SAMPLE_RATE, SAMPLES_PER_FRAME):
            raise CheckpointError(
                f"speech tokenizer input/output_sample_rate {rates[0]}/{rates[1]} Hz, decode_upsample_rate {rates[2]}: "
                f"this port serves {SAMPLE_RATE} Hz audio in frames of {SAMPLES_PER_FRAME} samples"
            )
        if cfg.decode_upsample_rate != cfg.decoder.samples_per_frame:
            raise CheckpointError(
                f"decode_upsample_rate {cfg.decode_upsample_rate} != product of the decoder's rates "
                f"{cfg.decoder.samples_per_frame}"
            )
        e = cfg.encoder
        if e is not None:
            # The reference trims to ceil(n / encode_downsample_rate) frames; Mimi makes ceil(n / frame_size).
            if cfg.encode_downsample_rate != e.frame_size:
                raise CheckpointError(
                    f"encode_downsample_rate {cfg.encode_downsample_rate} != the encoder's samples per frame {e.frame_size}"
                )
            if not e.num_semantic_quantizers < cfg.encoder_valid_num_quantizers <= e.num_quantizers:
                raise CheckpointError(
                    f"encoder_valid_num_quantizers {cfg.encoder_valid_num_quantizers} must exceed the "
                    f"{e.num_semantic_quantizers} semantic and not exceed the {e.num_quantizers} encoder codebooks"
                )
        return cfg

    @classmethod
    def from_file(cls, path: Path) -> "CodecConfig":
        """Read ``path`` (a config.json, or a ``speech_tokenizer`` directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise CheckpointError(f"speech tokenizer config {path} does not exist")
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def _require(d: Mapping[str, Any], where: str, keys: list[str]) -> None:
    missing = [k for k in keys if k not in d]
    if missing:
        raise CheckpointError(f"{where} lacks required field(s): {', '.join(missing)}")
