# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Explore a model
# Synthesize through the server, listen, look at the waveform and spectrogram and at where the time to first
# audio goes. With no `server_url` the notebook starts its own local server on the embedded default model
# (`tiny-random`: random weights, so the audio is noise) for the one request, and stops it.

# %% tags=["parameters"]
server_url = ""  # a running server; empty: start a local one on `model` for this notebook
model = "tiny-random"  # local server: checkpoint directory or tiny-random
text = "Hi, how can I help you today?"
voice = "ryan"
seed = 0
max_frames = 48
out_dir = "runs/explore"

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import soundfile
from IPython.display import Audio, Markdown, display

from studies.explore import synthesize
from studies.plots import show
from studies.server import local_server

out = Path(out_dir)
out.mkdir(parents=True, exist_ok=True)
options = {"seed": seed}
if max_frames:
    options["max_frames"] = max_frames
if server_url:
    s = synthesize(server_url, text, voice, **options)
else:
    with local_server(model, slots=1, log_path=out / "server.log") as url:
        s = synthesize(url, text, voice, **options)
seconds = len(s.audio) / s.sample_rate
soundfile.write(out / "speech.wav", s.audio, s.sample_rate, subtype="PCM_16")
display(Markdown(f"**{text}** ({voice}): {seconds:.2f} s of audio at {s.sample_rate} Hz in {s.wall_ms:.0f} ms "
                 f"(real-time factor {s.wall_ms / 1000 / seconds:.2f}); saved as `speech.wav`"))
display(Audio(s.audio, rate=s.sample_rate))

# %%
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
ax1.plot(np.arange(len(s.audio)) / s.sample_rate, s.audio, lw=0.3)
ax1.set(title="waveform", ylabel="amplitude (full scale = 1)")
ax1.tick_params(labelbottom=False)  # the shared time axis is labelled once, under the spectrogram
_, _, _, image = ax2.specgram(s.audio, NFFT=512, Fs=s.sample_rate, noverlap=384)
fig.colorbar(image, ax=[ax1, ax2], label="power spectral density (dB/Hz)")
ax2.set(title="spectrogram", ylabel="frequency (Hz)", xlabel="time (s)", xlim=(0, seconds))
show(fig, out / "spectrogram.png")

# %% [markdown]
# ## Timing breakdown (server side, ms since the request was submitted)

# %%
marks = [(k, s.timings[k]) for k in ("queue_ms", "prefill_ms", "first_frame_ms", "first_chunk_ms", "total_ms")
         if s.timings.get(k) is not None]
fig, ax = plt.subplots(figsize=(8, 2.5))
prev = 0.0
for name, t in marks:
    ax.barh(0, t - prev, left=prev, label=f"{name[:-3]} (+{t - prev:.0f} ms)")
    prev = t
ax.set(yticks=[], xlabel="time since submission (ms)")
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=3, fontsize="small")
fig.tight_layout()
show(fig, out / "timings.png")
_ = (out / "summary.json").write_text(json.dumps({"text": text, "voice": voice, "audio_s": seconds,
                                                  "wall_ms": s.wall_ms, "timings": s.timings}, indent=2))
