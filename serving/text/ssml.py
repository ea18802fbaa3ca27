"""SSML input: a `<speak>` document -> what to say, piece by piece: runs of text with their prosody and emphasis,
and pauses.

Parsed by the standard library's expat with every door of XML's attack surface shut: a document type
declaration is refused outright (so no entity can be declared: no billion laughs, no external entity, no
parameter entity), external references are never resolved, nesting deeper than MAX_DEPTH stops the parse at
that element, and the document is no longer than the input field allows. Anything malformed or not supported
is an `ApiError` 400 naming the element (and attribute), raised before anything reaches the engine.

Supported: `speak`; `p`, `s` (boundaries); `break` (`time` up to 10 s, or `strength`); `prosody` (`rate`,
`pitch`, `volume`; nested ones multiply and add up); `sub alias`; `say-as` (`characters`/`spell-out`,
`digits`, `date` with `format`, `telephone`: rewritten as the English words to say); `emphasis` (`level`,
spoken through the model's style instruction where it takes one, see serving/text/script.py).
"""

from __future__ import annotations

import dataclasses
import re
from xml.parsers import expat

from serving.audio.prosody import GAIN_DB_RANGE, PITCH_RANGE, RATE_RANGE, Prosody
from serving.errors import ApiError, bad
from serving.schemas import check_text

MAX_DEPTH = 32
MAX_BREAK_S = 10.0
MAX_PAUSES_S = 60.0  # all pauses of a document: silence costs no compute, but a whole file holds it in memory
MAX_PIECES = 100  # runs and pauses; each run is at least one engine request
ATTRIBUTES = {"speak": {"version", "xmlns", "xml:lang", "xmlns:xsi", "xsi:schemaLocation"},
              "p": {"xml:lang"}, "s": {"xml:lang"}, "break": {"time", "strength"},
              "prosody": {"rate", "pitch", "volume"}, "sub": {"alias"}, "say-as": {"interpret-as", "format", "detail"},
              "emphasis": {"level"}}
BREAK_STRENGTH_S = {"none": 0.0, "x-weak": 0.1, "weak": 0.25, "medium": 0.4, "strong": 0.7, "x-strong": 1.0}
RATES = {"x-slow": 0.5, "slow": 0.75, "medium": 1.0, "default": 1.0, "fast": 1.25, "x-fast": 1.5}
PITCHES = {"x-low": 0.8, "low": 0.9, "medium": 1.0, "default": 1.0, "high": 1.1, "x-high": 1.25}
VOLUMES_DB = {"silent": None, "x-soft": -12.0, "soft": -6.0, "medium": 0.0, "default": 0.0, "loud": 6.0,
              "x-loud": 12.0}
EMPHASIS = {"strong": "Say this with strong emphasis.", "moderate": "Say this with emphasis.",
            "reduced": "Say this softly, without emphasis.", "none": None}
SAY_AS = ("characters", "spell-out", "digits", "date", "telephone")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December")
_SPACE_BEFORE_MARK = re.compile(r" ([,.;:!?])")  # left by a rewritten say-as or sub before its punctuation
_NUMBER = re.compile(r"^([+-]?)(\d+(?:\.\d+)?)(%|st|dB|ms|s)?$")


@dataclasses.dataclass(frozen=True)
class Speech:
    text: str
    prosody: Prosody = Prosody()
    emphasis: str | None = None  # a style instruction, for models that take one


@dataclasses.dataclass(frozen=True)
class Pause:
    seconds: float


def is_input(text: str, opts: dict) -> bool:
    """Whether `text` is read as SSML: `input_format` ssml, or auto (the default) and it starts as an XML document
    does (`<speak`, `<?xml`, `<!DOCTYPE`)."""
    fmt = opts.get("input_format", "auto")
    return fmt == "ssml" or (fmt == "auto" and text.lstrip().startswith(("<speak", "<?xml", "<!DOCTYPE")))


def parse(document: str) -> list[Speech | Pause]:
    """The pieces of `document`, in order: adjacent text of the same style joined, whitespace collapsed."""
    return _Parser().run(document)


def _error(element: str, message: str) -> ApiError:
    return bad("input", f"SSML <{element}>: {message}", "invalid_ssml")


class _Frame:
    def __init__(self, tag: str, prosody: Prosody, emphasis: str | None):
        self.tag, self.prosody, self.emphasis = tag, prosody, emphasis
        self.text: list[str] | None = [] if tag in ("sub", "say-as") else None  # collected, then rewritten
        self.attrs: dict = {}


class _Parser:
    def __init__(self):
        self.stack: list[_Frame] = []
        self.pieces: list[Speech | Pause] = []
        self.run_text: list[str] = []
        self.run_style: tuple | None = None
        self.pauses = 0.0

    def run(self, document: str) -> list[Speech | Pause]:
        p = expat.ParserCreate()
        p.SetParamEntityParsing(expat.XML_PARAM_ENTITY_PARSING_NEVER)
        p.StartDoctypeDeclHandler = self._doctype
        p.EntityDeclHandler = self._doctype  # unreachable without a DOCTYPE; shut all the same
        p.ExternalEntityRefHandler = self._doctype
        p.StartElementHandler = self._start
        p.EndElementHandler = self._end
        p.CharacterDataHandler = self._text
        try:
            p.Parse(document, True)
        except expat.ExpatError as exc:
            raise bad("input", f"SSML is not well-formed XML: {expat.ErrorString(exc.code)} (line {exc.lineno}, "
                               f"column {exc.offset + 1})", "invalid_ssml") from None
        self._flush()
        if not any(isinstance(piece, Speech) for piece in self.pieces):
            raise bad("input", "the SSML document has no text to speak", "empty")
        return self.pieces

    def _doctype(self, *_):
        raise _error("!DOCTYPE", "document type declarations (and with them entities) are not accepted")

    def _start(self, tag: str, attrs: dict) -> None:
        if len(self.stack) >= MAX_DEPTH:
            raise _error(tag, f"nesting deeper than {MAX_DEPTH} elements")
        if not self.stack and tag != "speak":
            raise _error(tag, "the document's root element must be <speak>")
        if tag not in ATTRIBUTES or (tag == "speak" and self.stack):
            raise _error(tag, f"unknown or unsupported element; supported: {sorted(ATTRIBUTES)}")
        if self.stack and self.stack[-1].text is not None:
            raise _error(tag, f"<{self.stack[-1].tag}> holds text only")
        for name in attrs:
            if name not in ATTRIBUTES[tag] and not name.startswith("xmlns:"):
                raise _error(tag, f"unknown attribute {name!r}; supported: {sorted(ATTRIBUTES[tag])}")
        top = self.stack[-1] if self.stack else None
        prosody, emphasis = (top.prosody, top.emphasis) if top else (Prosody(), None)
        if tag == "break":
            self._pause(_break_seconds(attrs))
        elif tag == "prosody":
            prosody = _prosody(prosody, attrs)
        elif tag == "emphasis":
            level = attrs.get("level", "moderate")
            if level not in EMPHASIS:
                raise _error(tag, f"level {level!r} is not one of {list(EMPHASIS)}")
            emphasis = EMPHASIS[level]
        elif tag in ("p", "s"):
            self._add(" ", None)
        elif tag == "sub" and not attrs.get("alias", "").strip():
            raise _error(tag, "needs a non-empty alias")
        elif tag == "say-as" and attrs.get("interpret-as") not in SAY_AS:
            raise _error(tag, f"interpret-as {attrs.get('interpret-as')!r} is not one of {list(SAY_AS)}")
        frame = _Frame(tag, prosody, emphasis)
        frame.attrs = attrs
        self.stack.append(frame)

    def _end(self, tag: str) -> None:
        frame = self.stack.pop()
        if tag == "sub":
            self._add(f" {frame.attrs['alias']} ", frame)
        elif tag == "say-as":
            self._add(f" {_say_as(frame.attrs, ''.join(frame.text))} ", frame)
        elif tag in ("p", "s"):
            self._add(" ", None)

    def _text(self, data: str) -> None:
        if not self.stack:
            return
        top = self.stack[-1]
        if top.text is not None:
            top.text.append(data)
        else:
            self._add(data, top)

    def _add(self, text: str, frame: _Frame | None) -> None:
        """Text in `frame`'s style (None: whitespace that goes with any style)."""
        check_text("input", text)
        if frame is not None:
            style = (frame.prosody, frame.emphasis)
            if style != self.run_style and "".join(self.run_text).strip():
                self._flush()
            self.run_style = style
        self.run_text.append(text)

    def _flush(self) -> None:
        text = _SPACE_BEFORE_MARK.sub(r"\1", " ".join("".join(self.run_text).split()))
        if text:
            prosody, emphasis = self.run_style or (Prosody(), None)
            self._piece(Speech(text, prosody, emphasis))
        self.run_text = []

    def _pause(self, seconds: float) -> None:
        self._flush()
        self.pauses += seconds
        if self.pauses > MAX_PAUSES_S:
            raise _error("break", f"the document's pauses add up to more than {MAX_PAUSES_S:g} s")
        if self.pieces and isinstance(self.pieces[-1], Pause):
            self.pieces[-1] = Pause(self.pieces[-1].seconds + seconds)
        elif seconds > 0:
            self._piece(Pause(seconds))

    def _piece(self, piece) -> None:
        if len(self.pieces) >= MAX_PIECES:
            raise bad("input", f"the SSML document has more than {MAX_PIECES} runs of text and pauses; join "
                               "runs of the same style", "too_long")
        self.pieces.append(piece)


def _value(tag: str, attr: str, raw: str, units: tuple) -> tuple[str, float, str]:
    """(sign, number, unit) of an attribute such as "+10%", "2st", "-6dB", "120ms"; 400 naming it otherwise."""
    m = _NUMBER.match(raw.strip())
    if m is None or (m.group(3) or "") not in units:
        raise _error(tag, f"{attr}={raw!r} is not understood; give {' or '.join(u or 'a number' for u in units)}")
    return m.group(1), float(m.group(2)), m.group(3) or ""


def _break_seconds(attrs: dict) -> float:
    if "time" in attrs:
        sign, n, unit = _value("break", "time", attrs["time"], ("ms", "s"))
        if sign == "-":
            raise _error("break", "time must not be negative")
        seconds = n / 1000 if unit == "ms" else n
        if seconds > MAX_BREAK_S:
            raise _error("break", f"time {attrs['time']} is longer than {MAX_BREAK_S:g} s")
        return seconds
    strength = attrs.get("strength", "medium")
    if strength not in BREAK_STRENGTH_S:
        raise _error("break", f"strength {strength!r} is not one of {list(BREAK_STRENGTH_S)}")
    return BREAK_STRENGTH_S[strength]


def _factor(attr: str, raw: str, keywords: dict, units: tuple) -> float:
    """A rate or pitch: a keyword, "150%" (of the default), "+20%"/"-20%" (relative), "1.5", "+2st"."""
    if raw in keywords:
        return keywords[raw]
    sign, n, unit = _value("prosody", attr, raw, units)
    if unit == "st":
        return 2 ** ((-n if sign == "-" else n) / 12)
    if unit == "%":
        return 1 + (n if sign == "+" else -n) / 100 if sign else n / 100
    return n


def _prosody(outer: Prosody, attrs: dict) -> Prosody:
    rate, pitch, gain = outer.rate, outer.pitch, outer.gain_db
    if "rate" in attrs:
        rate *= _factor("rate", attrs["rate"], RATES, ("%", ""))
    if "pitch" in attrs:
        pitch *= _factor("pitch", attrs["pitch"], PITCHES, ("%", "st"))
    if "volume" in attrs:
        raw = attrs["volume"]
        if raw in VOLUMES_DB:
            db = VOLUMES_DB[raw]
        else:
            sign, n, _ = _value("prosody", "volume", raw, ("dB",))
            db = -n if sign == "-" else n
        gain = None if gain is None or db is None else gain + db
    for name, value, (lo, hi) in (("rate", rate, RATE_RANGE), ("pitch", pitch, PITCH_RANGE)):
        if not lo <= value <= hi:
            raise _error("prosody", f"{name} comes to {value:g} times the default here; it must stay within "
                                    f"{lo:g}-{hi:g}")
    if gain is not None and not GAIN_DB_RANGE[0] <= gain <= GAIN_DB_RANGE[1]:
        raise _error("prosody", f"volume comes to {gain:+g} dB here; it must stay within "
                                f"{GAIN_DB_RANGE[0]:+g} to {GAIN_DB_RANGE[1]:+g} dB")
    return Prosody(rate, pitch, gain)


def _say_as(attrs: dict, text: str) -> str:
    kind, text = attrs["interpret-as"], " ".join(text.split())
    if kind in ("characters", "spell-out", "digits"):
        return " ".join(c for c in text if not c.isspace())
    if kind == "telephone":
        groups = re.findall(r"\d+", text)
        if not groups:
            raise _error("say-as", f"telephone {text!r} has no digits")
        return ("plus " if text.startswith("+") else "") + ", ".join(" ".join(g) for g in groups)
    return _date(attrs.get("format", "ymd"), text)


def _date(fmt: str, text: str) -> str:
    """A date in the order `fmt` (y, m, d: "mdy", "dmy", "ymd", "md", "my", ...) -> "March 5, 2024"."""
    fields = re.split(r"[-/.\s]+", text.strip())
    if not re.fullmatch(r"[ymd]{1,3}", fmt) or len(set(fmt)) != len(fmt) or len(fields) != len(fmt) or not all(
            f.isdigit() for f in fields):
        raise _error("say-as", f"date {text!r} does not read as format {fmt!r} (y, m and d, e.g. mdy: 3/5/2024)")
    parts = dict(zip(fmt, map(int, fields)))
    if not 1 <= parts.get("m", 1) <= 12 or not 1 <= parts.get("d", 1) <= 31:
        raise _error("say-as", f"date {text!r} has no such month or day (format {fmt!r})")
    month_day = " ".join(x for x in (MONTHS[parts["m"] - 1] if "m" in parts else "", str(parts.get("d", ""))) if x)
    year = str(parts.get("y", ""))
    return f"{month_day}, {year}" if "m" in parts and "d" in parts and year else " ".join(x for x in (month_day, year) if x)
