"""SSML documents -> pieces to say (the parser, its limits and refusals) and prosody on audio. Through the server,
with its timing and memory targets: test_server_text.py."""

import numpy as np
import pytest

from serving.audio.prosody import Prosody, ProsodyAudio
from serving.errors import ApiError
from serving.text.ssml import Pause, Speech, parse


def test_pieces_text_rewrites_and_styles():
    doc = ("<speak xmlns='http://www.w3.org/2001/10/synthesis' version='1.1'><p><s>Hello,</s> <s>world.</s></p>"
           "<break time='1.5s'/><break strength='weak'/>"
           "Call <say-as interpret-as='telephone'>+1 (555) 123-4567</say-as> on "
           "<say-as interpret-as='date' format='mdy'>3/5/2024</say-as>, code "
           "<say-as interpret-as='characters'>AB12</say-as>, digits <say-as interpret-as='digits'>42</say-as> at the "
           "<sub alias='World Wide Web Consortium'>W3C</sub>. "
           "<prosody rate='-20%' pitch='+2st' volume='loud'>Slow <prosody rate='x-fast' volume='-3dB'>quick</prosody>"
           "</prosody><emphasis level='reduced'>quiet</emphasis></speak>")
    assert parse(doc) == [
        Speech("Hello, world."), Pause(1.75),
        Speech("Call plus 1, 5 5 5, 1 2 3, 4 5 6 7 on March 5, 2024, code A B 1 2, digits 4 2 at the World Wide "
               "Web Consortium."),
        Speech("Slow", Prosody(0.8, 2 ** (2 / 12), 6.0)), Speech("quick", Prosody(0.8 * 1.5, 2 ** (2 / 12), 3.0)),
        Speech("quiet", emphasis="Say this softly, without emphasis.")]


@pytest.mark.parametrize("doc, message", [
    ("<speak><voice name='x'>hi</voice></speak>", "SSML <voice>: unknown or unsupported element"),
    ("<speak><break time='10.5s'/>hi</speak>", "SSML <break>: time 10.5s is longer than 10 s"),
    ("<speak><break time='soon'/>hi</speak>", "SSML <break>: time='soon' is not understood"),
    ("<speak><prosody rate='x-fast'><prosody rate='x-fast'>hi</prosody></prosody></speak>",
     "SSML <prosody>: rate comes to 2.25 times the default here; it must stay within 0.5-2"),
    ("<speak><prosody pitch='+20Hz'>hi</prosody></speak>", "SSML <prosody>: pitch='+20Hz' is not understood"),
    ("<speak><prosody volume='+30dB'>hi</prosody></speak>", "SSML <prosody>: volume comes to +30 dB here"),
    ("<speak><prosody speed='2'>hi</prosody></speak>", "SSML <prosody>: unknown attribute 'speed'"),
    ("<speak><say-as interpret-as='cardinal'>12</say-as></speak>", "SSML <say-as>: interpret-as 'cardinal'"),
    ("<speak><say-as interpret-as='date' format='dmy'>31/13/2024</say-as></speak>", "no such month or day"),
    ("<speak><sub>W3C</sub></speak>", "SSML <sub>: needs a non-empty alias"),
    ("<speak><say-as interpret-as='digits'><s>1</s></say-as></speak>", "SSML <s>: <say-as> holds text only"),
    ("<p>hi</p>", "SSML <p>: the document's root element must be <speak>"),
    ("<speak>hi &nbsp; there</speak>", "SSML is not well-formed XML: undefined entity (line 1, column 11)"),
    ("<speak>" + "<break time='9s'/>x" * 7 + "</speak>", "the document's pauses add up to more than 60 s"),
    ("<speak>&#x85;</speak>", "must not contain control characters (found U+0085)"),
])
def test_refusals_name_the_element(doc, message):
    with pytest.raises(ApiError) as err:
        parse(doc)
    assert err.value.status == 400 and err.value.field == "input" and message in err.value.message


def test_prosody_audio_rate_pitch_gain():
    t = np.arange(24000) / 24000
    tone = (0.5 * np.sin(2 * np.pi * 200 * t)).astype(np.float32)

    def run(prosody):
        shape = ProsodyAudio(prosody)
        return np.concatenate([shape.process(tone[i:i + 1920]) for i in range(0, len(tone), 1920)] + [shape.finish()])

    def peak_hz(x):
        return np.argmax(np.abs(np.fft.rfft(x * np.hanning(len(x))))) * 24000 / len(x)

    assert np.array_equal(run(Prosody()), tone)
    fast = run(Prosody(rate=1.5))
    assert abs(len(fast) - len(tone) / 1.5) <= 1 and abs(peak_hz(fast) - 200) < 3  # shorter, same pitch
    high = run(Prosody(pitch=2 ** (3 / 12)))
    assert abs(len(high) - len(tone)) <= 1 and abs(peak_hz(high) - 200 * 2 ** (3 / 12)) < 3  # same length, higher
    assert np.allclose(run(Prosody(gain_db=-6)), tone * 10 ** (-6 / 20)) and not run(Prosody(gain_db=None)).any()
