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
# # First chunk × start-up buffer
# For each first-chunk size one load condition is measured; each start-up buffer is simulated on the same
# recorded chunk arrivals. "Start" is when the player starts (TTFA plus the buffer fill); starvation is
# what the listener hears as gaps after that.

# %% tags=["parameters"]
server_url = "http://127.0.0.1:8000"
mode = "closed"
load = 1  # clients (closed) or requests/s (open)
first_chunks = [1, 2, 4, 8]  # frames (80 ms each)
buffers_ms = [0, 100, 200, 400]
requests_per_condition = 20
warmup = 1
corpus = "voice_agent"
voice = "ryan"
max_frames = 48
ttfa_p95_ms = 300.0
starvation_p95_ms = 100.0
out_dir = "runs/chunk_buffer"

# %%
import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

from studies.chunk_buffer import chunk_buffer_grid
from studies.corpora import load_corpus
from studies.plots import show

options = {"voice": voice, "seed": 0}
if max_frames:
    options["max_frames"] = max_frames
rows = chunk_buffer_grid(server_url, first_chunks, buffers_ms, load, requests_per_condition, load_corpus(corpus),
                         out_dir, options=options, mode=mode, warmup=warmup)

# %%
table = ["| first chunk (frames) | buffer ms | success | TTFA p95 ms | start p95 ms | starvation p95 ms | underruns (mean) | meets both |",
         "|---|---|---|---|---|---|---|---|"]
for r in rows:
    meets = r["start_p95_ms"] <= ttfa_p95_ms and r["starvation_p95_ms"] <= starvation_p95_ms
    table.append(f"| {r['first_chunk']} | {r['buffer_ms']:g} | {r['success_rate']:.0%} | {r['ttfa_p95_ms']:.0f} "
                 f"| {r['start_p95_ms']:.0f} | {r['starvation_p95_ms']:.0f} | {r['underruns_mean']:.2f} "
                 f"| {'yes' if meets else 'no'} |")
display(Markdown(f"{mode} loop at load {load:g}; start is judged against the {ttfa_p95_ms:g} ms TTFA target\n\n"
                 + "\n".join(table)))

# %%
def grid(key):
    return np.array([[next(r[key] for r in rows if r["first_chunk"] == f and r["buffer_ms"] == b)
                      for b in buffers_ms] for f in first_chunks])


fig, axes = plt.subplots(1, 2, figsize=(12, 4))
for ax, key, title in ((axes[0], "start_p95_ms", "p95 playback start (ms)"),
                       (axes[1], "starvation_p95_ms", "p95 starvation (ms)")):
    values = grid(key)
    im = ax.imshow(values, cmap="viridis", aspect="auto")
    ax.set(title=title, xlabel="start-up buffer (ms)", ylabel="first chunk (frames)",
           xticks=range(len(buffers_ms)), xticklabels=[f"{b:g}" for b in buffers_ms],
           yticks=range(len(first_chunks)), yticklabels=first_chunks)
    for (i, j), v in np.ndenumerate(values):
        ax.text(j, i, f"{v:.0f}", ha="center", va="center", color="white")
    fig.colorbar(im, ax=ax, label="ms")
fig.tight_layout()
show(fig, f"{out_dir}/chunk_buffer.png")
