"""Model configuration read from a checkpoint's `config.json` and `generation_config.json`.

Values come from the files, never from the reference classes' defaults (which do not match the released
checkpoints). A key the computation depends on and the file lacks is an error naming the key.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from qtts_jax.io.errors import CheckpointError


def _need(d: Mapping[str, Any], key: str, where: str):
    if key not in d:
        raise CheckpointError(f"{where}: required key '{key}' is missing")
    return d[key]


class FrozenDict(dict):
    """A read-only dict that hashes, so configs holding name tables can be static jit arguments."""

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.items())))

    def _readonly(self, *args, **kwargs):
        raise TypeError("config tables are read-only")

    __setitem__ = __delitem__ = update = pop = clear = setdefault = _readonly

    def __reduce__(self):
        """Pickled whole (a dict's pickle sets items one by one): a config crosses to the server's process."""
        return FrozenDict, (dict(self),)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """One Qwen3-style decoder stack (talker or code predictor): qk-norm GQA attention + SwiGLU MLP."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str) -> "DecoderConfig":
        hidden = _need(d, "hidden_size", where)
        heads = _need(d, "num_attention_heads", where)
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"{where}: hidden_act '{act}' is not supported (only silu)")
        if d.get("attention_bias"):
            raise CheckpointError(f"{where}: attention_bias=true is not supported")
        scaling = d.get("rope_scaling") or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type != "default":
            raise CheckpointError(f"{where}: rope_scaling type '{rope_type}' is not supported")
        return cls(
            hidden_size=hidden,
            intermediate_size=_need(d, "intermediate_size", where),
            num_layers=_need(d, "num_hidden_layers", where),
            num_heads=heads,
            num_kv_heads=_need(d, "num_key_value_heads", where),
            # The reference reads head_dim with getattr(..., hidden // heads); keep that fallback.
            head_dim=d.get("head_dim") or hidden // heads,
            rope_theta=float(_need(d, "rope_theta", where)),
            rms_norm_eps=float(_need(d, "rms_norm_eps", where)),
            vocab_size=_need(d, "vocab_size", where),
        )


@dataclasses.dataclass(frozen=True)
class CodecIds:
    """Special ids of the talker's codec vocabulary."""

    pad: int
    bos: int
    eos: int
    think: int
    nothink: int
    think_bos: int
    think_eos: int


@dataclasses.dataclass(frozen=True)
class TextIds:
    """Special ids of the text vocabulary that the prompt layout embeds."""

    tts_pad: int
    tts_bos: int
    tts_eos: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the talker, code predictor and prompt builder need from `config.json`."""

    talker: DecoderConfig
    predictor: DecoderConfig
    text_vocab_size: int
    text_hidden_size: int
    num_code_groups: int
    codec: CodecIds
    text: TextIds
    languages: Mapping[str, int]  # lower-case name -> codec id (dialects included)
    speakers: Mapping[str, int]  # lower-case name -> codec id (CustomVoice only)
    speaker_dialect: Mapping[str, str | None]  # speaker -> dialect language name, or None
    model_type: str  # "base" | "custom_voice" | "voice_design"
    model_size: str  # "0b6" | "1b7"
    speaker_embedding_dim: int | None  # Base models: x-vector size (must equal talker hidden)

    @property
    def accepts_instruct(self) -> bool:
        """The reference drops instructions on 0.6B models and never passes them to Base."""
        return self.model_type != "base" and self.model_size != "0b6"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        t = _need(d, "talker_config", "config.json")
        cp = _need(t, "code_predictor_config", "config.json talker_config")
        tokenizer_type = d.get("tokenizer_type")
        if tokenizer_type != "qwen3_tts_tokenizer_12hz":
            raise CheckpointError(
                f"config.json: tokenizer_type '{tokenizer_type}' is not supported (only qwen3_tts_tokenizer_12hz)"
            )
        where = "config.json talker_config"
        spk = FrozenDict({k.lower(): _single_id(v) for k, v in (t.get("spk_id") or {}).items()})
        dialect = FrozenDict({k.lower(): (v or None) for k, v in (t.get("spk_is_dialect") or {}).items()})
        model_type = _need(d, "tts_model_type", "config.json")
        spk_cfg = d.get("speaker_encoder_config") or {}
        return cls(
            talker=DecoderConfig.from_dict(t, where),
            predictor=DecoderConfig.from_dict(cp, where + ".code_predictor_config"),
            text_vocab_size=_need(t, "text_vocab_size", where),
            text_hidden_size=_need(t, "text_hidden_size", where),
            num_code_groups=_need(t, "num_code_groups", where),
            codec=CodecIds(
                pad=_need(t, "codec_pad_id", where),
                bos=_need(t, "codec_bos_id", where),
                eos=_need(t, "codec_eos_token_id", where),
                think=_need(t, "codec_think_id", where),
                nothink=_need(t, "codec_nothink_id", where),
                think_bos=_need(t, "codec_think_bos_id", where),
                think_eos=_need(t, "codec_think_eos_id", where),
            ),
            text=TextIds(
                tts_pad=_need(d, "tts_pad_token_id", "config.json"),
                tts_bos=_need(d, "tts_bos_token_id", "config.json"),
                tts_eos=_need(d, "tts_eos_token_id", "config.json"),
            ),
            languages=FrozenDict({k.lower(): v for k, v in (_need(t, "codec_language_id", where) or {}).items()}),
            speakers=spk,
            speaker_dialect=dialect,
            model_type=model_type,
            model_size=_need(d, "tts_model_size", "config.json"),
            speaker_embedding_dim=spk_cfg.get("enc_dim") if model_type == "base" else None,
        )

    @property
    def supported_languages(self) -> list[str]:
        """What a request may name: "auto" plus every non-dialect language (dialects come from speakers)."""
        return ["auto"] + [k for k in self.languages if "dialect" not in k]


def _single_id(v) -> int:
    """Released configs give speaker ids as ints or one-element lists; the reference accepts both."""
    return int(v[0]) if isinstance(v, (list, tuple)) else int(v)


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
    """`generation_config.json` keys the reference wrapper reads, with its hard fallbacks."""

    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    subtalker_dosample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    max_new_tokens: int = 2048

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SamplingDefaults":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def read_json(path: Path) -> dict:
    """Read a JSON file, turning absence or corruption into an error that names the file."""
    if not path.is_file():
        raise CheckpointError(f"missing file: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def load_config(directory: Path) -> tuple[ModelConfig, SamplingDefaults]:
    """Config and sampling defaults of a checkpoint directory (generation_config.json is optional)."""
    directory = Path(directory)
    cfg = ModelConfig.from_dict(read_json(directory / "config.json"))
    gen_path = directory / "generation_config.json"
    gen = SamplingDefaults.from_dict(read_json(gen_path)) if gen_path.is_file() else SamplingDefaults()
    return cfg, gen
