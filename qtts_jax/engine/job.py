"""One request as the engine will run it, made once by `Engine.prepare` and carried unchanged from validation
through admission to a slot, so nothing downstream resolves, lays out or bounds the request again."""

from __future__ import annotations

import dataclasses

from qtts_jax.prompt import Prompt
from qtts_jax.request import Request


@dataclasses.dataclass(frozen=True, eq=False)  # one request's object: compared by identity (it holds arrays)
class Job:
    request: Request  # resolved: every field checked against the model and filled in
    prompt: Prompt  # its token layout
    bucket: int  # the prompt bucket (cache rows) it is prefilled in
    frames_cap: int  # the most frames it may produce: max_frames, the runaway guard, the context left
    schedule: tuple[int, ...]  # frames per audio chunk, in order, the last repeating
    # live text (`Engine.append_text`): the prompt holds the text so far and `frames_cap` is its runaway guard;
    # both grow as text is appended
    live: bool = False
