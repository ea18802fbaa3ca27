"""Prompt layouts of every mode, built host-side exactly as the reference builds them.

Each prompt position is the sum of up to four parts: a projected text token P(t), a codec token
embedding E(c), a reference frame's summed codebook embeddings S(frame) (ICL), and the raw x-vector
(Base). A `Prompt` records those parts as id arrays, so embedding it is one jittable gather-and-add
for every mode. `trailing` holds the text ids fed one per generated frame (then tts_pad forever).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from qtts_jax import nn
from qtts_jax.talker import Talker
from qtts_jax.config import ModelConfig
from qtts_jax.request import Request
from qtts_jax.io.text import TextTokenizer

NONE = -1


@dataclasses.dataclass
class Prompt:
    text: np.ndarray  # [T] int32 text ids, NONE where a position has no text part
    codec: np.ndarray  # [T] int32 codec ids, NONE where none
    frames: np.ndarray  # [T, groups] int32 reference frames, NONE rows where none
    speaker_row: int  # position holding the x-vector, or NONE
    speaker: np.ndarray | None  # x-vector [H] (Base), else None
    trailing: np.ndarray  # [N] int32 text ids fed after the prompt, one per frame

    def __len__(self) -> int:
        return len(self.text)

    def frame_cap(self, base: int = 24, per_text_token: int = 8, trailing: int | None = None) -> int:
        """Runaway guard: speech runs about 3-4 frames per text token, so this cap is generous for
        real speech yet stops a model that never samples EOS from talking for minutes. `trailing`: the count of
        trailing ids when more have been appended since (live text)."""
        trailing = len(self.trailing) if trailing is None else trailing
        return base + per_text_token * (trailing + int(np.sum(self.text >= 0)))


class _Builder:
    """Positions as they are added; the frames array is made once at the end, as most positions have none (a
    long input's parts are hundreds of positions each, built while its request waits for its first audio)."""

    def __init__(self, groups: int):
        self.text: list[int] = []
        self.codec: list[int] = []
        self._frames: dict[int, np.ndarray] = {}  # position -> its reference frame
        self.groups = groups

    def add(self, text: int = NONE, codec: int = NONE, frame: np.ndarray | None = None) -> None:
        if frame is not None:
            self._frames[len(self.text)] = frame
        self.text.append(text)
        self.codec.append(codec)

    def add_text(self, ids, codec: int = NONE) -> None:
        """Positions of text ids, each beside the same codec id (a whole input's text in one go)."""
        self.text.extend(ids)
        self.codec.extend([codec] * len(ids))

    def frames(self) -> np.ndarray:
        out = np.full((len(self.text), self.groups), NONE, np.int32)
        for at, frame in self._frames.items():
            out[at] = frame
        return out


def build_prompt(cfg: ModelConfig, tok: TextTokenizer, req: Request) -> Prompt:
    """The reference's `Qwen3TTSForConditionalGeneration.generate` layout for one validated request."""
    ids = _target_ids(tok, req.text)
    role, text_ids = ids[:3], ids[3:-5]
    t = cfg.text
    b = _Builder(cfg.num_code_groups)
    if req.instruct:
        b.add_text(tok.encode(f"<|im_start|>user\n{req.instruct}<|im_end|>\n"))
    b.add_text(role)

    language_id = _language_id(cfg, req)
    if language_id is None:
        prefix = [cfg.codec.nothink, cfg.codec.think_bos, cfg.codec.think_eos]
    else:
        prefix = [cfg.codec.think, cfg.codec.think_bos, language_id, cfg.codec.think_eos]
    for c in prefix:
        b.add(text=t.tts_pad, codec=c)
    speaker_row, xvec = NONE, None
    if req.speaker is not None:
        b.add(text=t.tts_pad, codec=cfg.speakers[req.speaker.lower()])
    elif req.voice is not None:
        speaker_row, xvec = len(b.text), np.asarray(req.voice.xvector, np.float32)
        b.add(text=t.tts_pad)
    b.add(text=t.tts_bos, codec=cfg.codec.pad)

    voice = req.voice
    if voice is not None and voice.ref_codes is not None:
        ref_ids = tok.encode(f"<|im_start|>assistant\n{voice.ref_text}<|im_end|>\n")[3:-2]
        trailing = _icl(b, cfg, list(ref_ids) + list(text_ids) + [t.tts_eos], voice.ref_codes, req.non_streaming)
    elif req.non_streaming:
        b.add_text(text_ids, codec=cfg.codec.pad)
        b.add(text=t.tts_eos, codec=cfg.codec.pad)
        b.add(text=t.tts_pad, codec=cfg.codec.bos)
        trailing = []
    else:
        b.add(text=text_ids[0], codec=cfg.codec.bos)
        trailing = list(text_ids[1:]) + [t.tts_eos]
    return Prompt(
        text=np.asarray(b.text, np.int32),
        codec=np.asarray(b.codec, np.int32),
        frames=b.frames(),
        speaker_row=speaker_row,
        speaker=xvec,
        trailing=np.asarray(trailing, np.int32),
    )


def _target_ids(tok: TextTokenizer, text: str) -> list[int]:
    """The reference's target template: 3 role ids, the text's, 5 closing ids (never used)."""
    return tok.encode(f"<|im_start|>assistant\n{text}<|im_end|>\n<|im_start|>assistant\n")


def text_ids_of(tok: TextTokenizer, text: str) -> list[int]:
    """The ids the prompt layouts give `text` (tokenized inside the template, as the reference does)."""
    return _target_ids(tok, text)[3:-5]


def _language_id(cfg: ModelConfig, req: Request) -> int | None:
    """Language codec id; a dialect speaker turns chinese/auto into its dialect (the reference's rule)."""
    lang = req.language.lower()
    language_id = None if lang == "auto" else cfg.languages[lang]
    if req.speaker is not None and lang in ("chinese", "auto"):
        dialect = cfg.speaker_dialect.get(req.speaker.lower())
        if dialect:
            language_id = cfg.languages[dialect]
    return language_id


def _icl(b: _Builder, cfg: ModelConfig, text: list[int], ref_codes: np.ndarray, non_streaming: bool) -> list[int]:
    """ICL voice clone: reference text + target text + tts_eos beside codec_bos + the reference frames."""
    t = cfg.text
    codec_rows = [(cfg.codec.bos, None)] + [(NONE, f) for f in np.asarray(ref_codes)]
    if non_streaming:
        b.add_text(text, codec=cfg.codec.pad)
        for c, f in codec_rows:
            b.add(text=t.tts_pad, codec=c, frame=f)
        return []
    for j, (c, f) in enumerate(codec_rows):
        b.add(text=text[j] if j < len(text) else t.tts_pad, codec=c, frame=f)
    return text[len(codec_rows):]


def text_entry_frames(prompt: Prompt, n_text: int) -> np.ndarray:
    """The frame at whose step each of the request's `n_text` text tokens first reaches the talker: 0 for those in
    the prompt (all of them in the non-streaming layout); in the streaming layouts the last ones come in
    `trailing` (before its tts_eos), one per frame from frame 1."""
    return np.maximum(0, np.arange(n_text) + len(prompt.trailing) - n_text)


def embed_prompt(talker: Talker, text, codec, frames, speaker_row, speaker) -> jax.Array:
    """x [..., T, H] for one (padded) prompt or a batch of them (text [..., T], speaker_row [...], speaker [..., H]):
    sum of the parts present at each position; pads give zeros. A batch goes in whole, not under `jax.vmap`, so
    that training sums each table row's gradient once (`nn.rows`)."""
    x = jnp.where((text >= 0)[..., None], talker.embed_text(jnp.maximum(text, 0)), 0)
    x = x + jnp.where((codec >= 0)[..., None], nn.rows(talker.codec_embedding[...], jnp.maximum(codec, 0)), 0)
    has_frame = frames[..., 0] >= 0
    x = x + jnp.where(has_frame[..., None], talker.embed_codes(jnp.maximum(frames, 0)), 0)
    at_speaker = (jnp.arange(text.shape[-1]) == jnp.asarray(speaker_row)[..., None])[..., None]
    return jnp.where(at_speaker, x + jnp.asarray(speaker)[..., None, :].astype(x.dtype), x)
