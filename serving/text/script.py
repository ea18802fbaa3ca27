"""What one request says, as the engine's jobs and the pauses between them: the input (text, or an SSML document:
serving/text/ssml.py), each run of it cut into parts that fit one prompt (serving/text/long_text.py), every part prepared
with the request's voice, seed and settings. All parts are prepared before the first is submitted, so an input
the engine cannot take is refused whole, with a 400, before any audio (serving/utterance.py speaks a script)."""

from __future__ import annotations

import dataclasses

from qtts_jax.codec.config import SAMPLE_RATE, SAMPLES_PER_FRAME
from qtts_jax.engine import PromptTooLong
from qtts_jax.engine.job import Job
from qtts_jax.request import Request, RequestError
from serving.audio.prosody import Prosody
from serving.errors import bad, from_request_error
from serving.schemas import build_request
from serving.text import long_text, ssml

# Frames of speech per text token that a part is sized for when a long input is cut (prompt.py: real speech runs
# about 3-4), so the context left after its prompt holds its speech; an input one request takes is one part.
SPEECH_FRAMES_PER_TOKEN = 4
CHECK = "<speak>check</speak>"  # an input of every input_format: what a WebSocket session's options are tried with


@dataclasses.dataclass(frozen=True)
class Part:
    job: Job | None = None  # None: a pause
    pause_s: float = 0.0
    prosody: Prosody = Prosody()

    def max_samples(self, speed: float) -> int:
        """The most model-rate samples this part can become (after its prosody, to a sample); a pause is made
        `speed` times longer, so that it lasts `pause_s` once the whole stream is played at `speed`."""
        if self.job is None:
            return round(self.pause_s * SAMPLE_RATE * speed)
        return self.prosody.length(self.job.frames_cap * SAMPLES_PER_FRAME)


@dataclasses.dataclass(frozen=True)
class Script:
    parts: tuple[Part, ...]
    chars: int  # of the input, as sent (usage and metrics count them)

    @property
    def jobs(self) -> list[Job]:
        return [p.job for p in self.parts if p.job is not None]

    @property
    def frames_cap(self) -> int:
        return sum(job.frames_cap for job in self.jobs)

    def max_samples(self, speed: float = 1.0) -> int:
        return sum(p.max_samples(speed) for p in self.parts)


def build(opts: dict, *, engine, live: bool = False, **kw) -> Script:
    """Checked options (`input` and the fields `build_request` reads) -> the script; 400 naming the field.
    `live`: `input` is the text of a live utterance so far (serving/sockets/live_input.py), one job more text joins."""
    req, schedule = build_request(opts, engine=engine, **kw)
    text = opts["input"]
    if live:
        try:
            return Script((Part(engine.prepare(dataclasses.replace(req, text=text), schedule, live=True)),), len(text))
        except RequestError as exc:
            raise from_request_error(exc) from None
    pieces = ssml.parse(text) if ssml.is_input(text, opts) else [ssml.Speech(text)]
    parts = []
    for piece in _merge(pieces, engine.model.cfg.accepts_instruct):
        if isinstance(piece, ssml.Pause):
            parts.append(Part(pause_s=piece.seconds))
            continue
        instruct = " ".join(x for x in (req.instruct, piece.emphasis) if x) or None
        jobs = _jobs(engine, dataclasses.replace(req, instruct=instruct), schedule, piece.text)
        parts += [Part(job, prosody=piece.prosody) for job in jobs]
    return Script(tuple(parts), len(text))


def _merge(pieces: list, instructed: bool) -> list:
    """Adjacent runs that sound the same joined: emphasis matters only to a model that takes an instruction (on
    others it is dropped), and each run costs a prefill and a seam."""
    out = []
    for piece in pieces:
        if isinstance(piece, ssml.Speech) and not instructed:
            piece = dataclasses.replace(piece, emphasis=None)
        last = out[-1] if out else None
        if (isinstance(piece, ssml.Speech) and isinstance(last, ssml.Speech)
                and (piece.prosody, piece.emphasis) == (last.prosody, last.emphasis)):
            out[-1] = dataclasses.replace(last, text=f"{last.text} {piece.text}")
        else:
            out.append(piece)
    return out


def _jobs(engine, req: Request, schedule, text: str) -> list[Job]:
    """`text` as one job if one request takes it, else cut into parts whose prompt fits a bucket and whose speech
    (SPEECH_FRAMES_PER_TOKEN) fits the context left after it."""
    c, tok = engine.config, engine.model.tokenizer
    jobs: dict[str, Job] = {}

    def attempt(part: str, whole: bool) -> bool:
        try:
            job = engine.prepare(dataclasses.replace(req, text=part), schedule)
        except PromptTooLong:
            return False
        except RequestError as exc:  # the request's fault, not the length's
            raise from_request_error(exc) from None
        if not whole:  # a part's speech must fit the context left after its prompt (the whole input's is capped)
            speech = min(job.request.max_frames, SPEECH_FRAMES_PER_TOKEN * len(tok.encode(part)))
            if speech > c.context - job.bucket:
                return False
        jobs[part] = job
        return True

    if attempt(text.strip(), whole=True):
        return [jobs[text.strip()]]
    try:
        return [jobs[p] for p in long_text.split(text, lambda p: attempt(p, whole=False))]
    except ValueError:
        raise bad("instructions" if req.instruct else "input", "not even one character of the input fits the "
                  "model's prompt beside the instructions and the voice's reference text", "too_long") from None
