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
# Synthesize through the server, listen, look at the spectrogram and at where the time to first audio goes.

# %% tags=["parameters"]
server_url = "http://127.0.0.1:8000"
text = "Hi, how can I help you today?"
voice = "ryan"
seed = 0
max_frames = 48
out_dir = "runs/explore"

# %%
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Audio, Markdown, display

from studies.explore import synthesize

options = {"seed": seed}
if max_frames:
    options["max_frames"] = max_frames
s = synthesize(server_url, text, voice, **options)
seconds = len(s.audio) / s.sample_rate
display(Markdown(f"**{text}** ({voice}): {seconds:.2f} s of audio at {s.sample_rate} Hz in {s.wall_ms:.0f} ms "
                 f"(real-time factor {s.wall_ms / 1000 / seconds:.2f})"))
display(Audio(s.audio, rate=s.sample_rate))

# %%
fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
ax1.plot(range(len(s.audio)), s.audio, lw=0.3)
ax1.set(title="waveform", ylabel="amplitude")
ax2.specgram(s.audio, NFFT=512, Fs=s.sample_rate, noverlap=384)
ax2.set(title="spectrogram", ylabel="Hz", xlabel="seconds")
ax1.set_xticks([])
fig.tight_layout()
fig.savefig(Path(out_dir) / "spectrogram.png", dpi=100)
plt.show()

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
ax.set(yticks=[], xlabel="ms")
ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=3, fontsize="small")
fig.tight_layout()
fig.savefig(Path(out_dir) / "timings.png", dpi=100)
plt.show()
(Path(out_dir) / "summary.json").write_text(json.dumps({"text": text, "voice": voice, "audio_s": seconds,
                                                         "wall_ms": s.wall_ms, "timings": s.timings}, indent=2))
