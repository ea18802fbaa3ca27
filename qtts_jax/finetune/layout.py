"""Training sequences: the non-streaming inference prompt followed by the clip's frames, padded into batches.

A sequence is exactly what inference feeds the talker for the same text and voice (`prompt.build_prompt` with a
Base x-vector voice and ``non_streaming``: all text first, the x-vector in the speaker slot, codec_bos last),
then one position per frame (its 16 codebook embeddings plus tts_pad, as a generated frame is fed back). With
``start`` the codec_bos position, the talker's output at ``start + j`` predicts code0 of frame j (and EOS at
``start + frames``), and the code predictor of frame j reads that same hidden state: the one that has not seen
frame j's codes. Lengths are padded up to buckets so that a run compiles a few programs, not one per batch.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from qtts_jax.config import ModelConfig
from qtts_jax.finetune.data import Example
from qtts_jax.prompt import NONE, build_prompt
from qtts_jax.request import Request, VoicePrompt
from qtts_jax.io.text import TextTokenizer

BUCKET = 32  # sequence and frame lengths are padded up to a multiple of this
FILLER = -1  # `Batch.lengths` of a row that pads a short batch to its size: it has no targets


@dataclasses.dataclass(frozen=True)
class Batch:
    text: np.ndarray  # [B, T] int32 text ids, NONE where a position has none
    codec: np.ndarray  # [B, T] int32 codec ids, NONE where none
    frames: np.ndarray  # [B, T, 16] int32 frames fed at each position, NONE rows where none
    speaker_row: np.ndarray  # [B] int32 the x-vector's position
    speaker: np.ndarray  # [B, H] float32 x-vectors
    start: np.ndarray  # [B] int32 position of codec_bos
    codes: np.ndarray  # [B, N, 16] int32 target frames, 0 past a row's end
    lengths: np.ndarray  # [B] int32 frames per row; FILLER for a row that only pads the batch (no targets)

    def arrays(self) -> tuple[np.ndarray, ...]:
        return dataclasses.astuple(self)


def _bucket(n: int) -> int:
    return -(-n // BUCKET) * BUCKET


def sequence(cfg: ModelConfig, tok: TextTokenizer, example: Example) -> dict:
    """One example as unpadded arrays (see `Batch`)."""
    p = build_prompt(cfg, tok, Request(text=example.text, voice=VoicePrompt(example.xvector), non_streaming=True))
    n, groups = len(example.codes), cfg.num_code_groups
    return dict(
        text=np.concatenate([p.text, np.full(n, cfg.text.tts_pad, np.int32)]),
        codec=np.concatenate([p.codec, np.full(n, NONE, np.int32)]),
        frames=np.concatenate([p.frames, np.asarray(example.codes, np.int32).reshape(n, groups)]),
        speaker_row=p.speaker_row, speaker=p.speaker, start=len(p) - 1, codes=example.codes, lengths=n,
    )


def collate(cfg: ModelConfig, tok: TextTokenizer, examples: list[Example], size: int | None = None) -> Batch:
    """Right-padded batch: pads come after every real position, so causal attention never reads them. With
    ``size``, FILLER rows (copies of the first, without targets) make a short last batch the same shape."""
    seqs = [sequence(cfg, tok, e) for e in examples]
    seqs += [dict(seqs[0], lengths=FILLER)] * ((size or len(seqs)) - len(seqs))
    b, groups = len(seqs), cfg.num_code_groups
    t = _bucket(max(len(s["text"]) for s in seqs))
    n = _bucket(max(len(s["codes"]) for s in seqs))
    text, codec = np.full((b, t), NONE, np.int32), np.full((b, t), NONE, np.int32)
    frames = np.full((b, t, groups), NONE, np.int32)
    codes = np.zeros((b, n, groups), np.int32)
    for i, s in enumerate(seqs):
        k = len(s["text"])
        text[i, :k], codec[i, :k], frames[i, :k] = s["text"], s["codec"], s["frames"]
        codes[i, : len(s["codes"])] = s["codes"]
    return Batch(
        text=text, codec=codec, frames=frames,
        speaker_row=np.array([s["speaker_row"] for s in seqs], np.int32),
        speaker=np.stack([s["speaker"] for s in seqs]).astype(np.float32),
        start=np.array([s["start"] for s in seqs], np.int32),
        codes=codes, lengths=np.array([s["lengths"] for s in seqs], np.int32),
    )
