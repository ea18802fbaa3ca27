"""OpenAI voice names -> this model's voices, so OpenAI clients work with their defaults.

Clients such as pipecat (`alloy`) and livekit (`ash`) check voices against OpenAI's list before sending, so
a model's own speaker names never reach the server; the alias table maps OpenAI's names instead.

- CustomVoice models: each OpenAI name maps to one of the model's speakers (`DEFAULT`, chosen by the voices'
  described gender and register).
- Base models: each OpenAI name maps to a registered voice, by default of the same name (register a voice
  called `alloy`, or map `alloy=alice`).

Override with `--voice-aliases` / `QTTS_VOICE_ALIASES`: either `name=target,name=target` (merged over the
default) or the path of a JSON file `{"name": "target", ...}` read once at start-up; `none` disables aliases.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

OPENAI_VOICES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                 "shimmer", "verse")
# CustomVoice (Qwen3-TTS speakers): female vivian, serena, ono_anna, sohee; male ryan, aiden, eric, dylan, uncle_fu
DEFAULT = {"alloy": "serena", "ash": "ryan", "ballad": "aiden", "cedar": "eric", "coral": "vivian", "echo": "eric",
           "fable": "dylan", "marin": "sohee", "nova": "vivian", "onyx": "uncle_fu", "sage": "ono_anna",
           "shimmer": "serena", "verse": "aiden"}
_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")


def parse(spec: str) -> dict[str, str]:
    """The `voice_aliases` setting -> the overrides it gives; raises ValueError saying what is wrong."""
    spec = spec.strip()
    if not spec or spec.lower() == "none":
        return {}
    if "=" not in spec:
        path = Path(spec)
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"voice aliases: cannot read {path} as a JSON object ({exc})") from None
        if not isinstance(table, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in table.items()):
            raise ValueError(f"voice aliases: {path} must hold a JSON object of name -> voice strings")
        pairs = list(table.items())
    else:
        pairs = []
        for item in spec.split(","):
            name, sep, target = item.partition("=")
            if not sep:
                raise ValueError(f"voice aliases: {item!r} is not name=voice")
            pairs.append((name, target))
    out = {}
    for name, target in pairs:
        name, target = name.strip().lower(), target.strip().lower()
        if not _NAME.match(name) or not _NAME.match(target):
            raise ValueError(f"voice aliases: {name!r}={target!r}: names are lowercase letters, digits, '_', '.', '-'")
        out[name] = target
    return out


def table(spec: str, model_type: str, speakers) -> dict[str, str]:
    """The aliases in force: the default for the model kind, then the setting's overrides (or none at all).
    On a CustomVoice model every target must be a speaker (ValueError otherwise, at start-up)."""
    if spec.strip().lower() == "none":
        return {}
    if model_type == "custom_voice":
        base = {k: v for k, v in DEFAULT.items() if v in speakers}
    elif model_type == "base":
        base = {k: k for k in OPENAI_VOICES}
    else:
        return {}
    out = {**base, **parse(spec)}
    if model_type == "custom_voice":
        wrong = sorted(f"{k}={v}" for k, v in out.items() if v not in speakers)
        if wrong:
            raise ValueError(f"voice aliases {wrong} name no speaker of this model; speakers: {sorted(speakers)}")
    return out
