"""Request preparation: the one validation of a request, before anything is queued.

It reads only the model and the engine's config, so any thread may call it (the server prepares requests off the
engine's thread)."""

from __future__ import annotations

import dataclasses

from qtts_jax.engine.config import EngineConfig
from qtts_jax.engine.job import Job
from qtts_jax.model import Model
from qtts_jax.prompt import build_prompt
from qtts_jax.request import Request, RequestError


class PromptTooLong(RequestError):
    """The request cannot fit this engine's cache (a clean refusal, not a crash)."""


def prepare(model: Model, config: EngineConfig, request: Request, schedule: tuple[int, ...] | None = None,
            live: bool = False) -> Job:
    """Resolve a request, lay out and bucket its prompt, fix its frame cap and its chunk schedule (the config's by
    default). Raises `RequestError` (incl. `PromptTooLong`) at once.

    `live`: the request's text is what has arrived so far (at least one token: the server decides which ids can
    no longer change); more comes through `Engine.append_text`. It takes the streaming-text layout (the text fed beside the codes, one id a
    frame: the only layout text can join while the stream plays), without the tts_eos that ends the text."""
    c = config
    schedule = tuple(schedule or c.schedule)
    if any(n not in c.codec_sizes for n in schedule):  # the codec is compiled for these chunk sizes only
        raise RequestError("chunk_schedule", f"each entry must be one of {list(c.codec_sizes)}")
    if live:
        if request.voice is not None and request.voice.ref_codes is not None:
            raise RequestError("voice", "live text cannot take a voice cloned with its reference text (its "
                               "layout sets the text beside the reference frames in the prompt); use an "
                               "x-vector-only voice or a preset speaker")
        request = dataclasses.replace(request, non_streaming=False)
    req = request.resolved(model.cfg, model.defaults)
    prompt = build_prompt(model.cfg, model.tokenizer, req)
    if live:
        prompt = dataclasses.replace(prompt, trailing=prompt.trailing[:-1])  # tts_eos comes with the completion
    bucket = next((b for b in c.prompt_buckets if b >= len(prompt)), None)
    if bucket is None:
        raise PromptTooLong("text", f"prompt of {len(prompt)} tokens exceeds the largest bucket {max(c.prompt_buckets)}")
    check_trailing(c, len(prompt.trailing) + live)
    job = Job(request=req, prompt=prompt, bucket=bucket, frames_cap=0, schedule=schedule, live=live)
    return dataclasses.replace(job, frames_cap=frames_cap(c, job, len(prompt.trailing)))


def check_trailing(config: EngineConfig, count: int) -> None:
    """Refuse `count` trailing text ids (`PromptTooLong`): the buffer on the device holds `max_trailing` (a live
    text's count includes the tts_eos still to come)."""
    if count > config.max_trailing:
        raise PromptTooLong("text", f"{count} streaming text tokens exceed the {config.max_trailing} "
                                    "this engine holds (max_trailing)")


def frames_cap(config: EngineConfig, job: Job, trailing: int) -> int:
    """The most frames a job may make with `trailing` ids of text fed beside its codes."""
    c = config
    guard = job.prompt.frame_cap(c.frames_cap_base, c.frames_per_text_token, trailing)
    return min(job.request.max_frames, guard, c.context - job.bucket)
