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
# # Sustained A/B
# Two server builds under the same sustained closed-loop load, in the order A, B, B, A (two passes per
# build, the order reversed on the second). Each pass fills the server before timing, counts only items
# that finish inside the steady window (the final drain is excluded), and is valid only if no request
# failed and every response after each client's warm-up matched the golden recording made alone on A
# with the same seed. Workloads: *plain* (one paragraph per request) and *processed* (two turns as one SSML
# request, a pause and prosody done by the server, peak-normalised as one recording).

# %% tags=["parameters"]
url_a = "http://127.0.0.1:8000"
url_b = "http://127.0.0.1:8001"
label_a = "A"
label_b = "B"
workloads = ["plain", "processed"]
plain_corpus = "sustained_plain"  # one paragraph per line
processed_corpus = "sustained_processed"  # two turns per line, separated by " | "
items_per_workload = 0  # 0: every item of the corpus
protocol = "http"  # http | ws
voice = "ryan"
seed = 7
max_frames = None  # cap per request (80 ms frames); None for the model's own end
concurrency = 4
fill_s = 10.0
window_s = 90.0
pause_ms = 120.0  # processed: silence between the two turns
gpu = True  # sample GPU use and memory with nvidia-smi when present
gpu_ids = ""  # nvidia-smi -i (e.g. "0"); empty: every GPU
measured = False  # True: out_dir already holds this A/B's summary.json (measured where the servers run); only draw it
out_dir = "runs/sustained"

# %%
import json
import math
from pathlib import Path

import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from studies.plots import show
from studies.sustained import measure

out = Path(out_dir)
if measured:
    summary = json.loads((out / "summary.json").read_text())
else:
    summary = measure(out, url_a, url_b, label_a, label_b, workloads,
                      {"plain": plain_corpus, "processed": processed_corpus}, items_per_workload, voice, seed,
                      max_frames, concurrency, fill_s, window_s, protocol, pause_ms, gpu, gpu_ids or None)
names = {"A": summary["label_a"], "B": summary["label_b"]}
results = summary["workloads"]
protocol, concurrency, fill_s, window_s = (summary[k] for k in ("protocol", "concurrency", "fill_s", "window_s"))

# %% [markdown]
# ## Passes

# %%
def fmt(v, spec):
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


for workload, res in results.items():
    rows = ["| pass | build | req/s | p50 latency ms | p95 latency ms | mean outstanding | mean waiting "
            "| GPU use % | peak GPU MiB | failed | golden mismatches | valid |", "|" + "---|" * 12]
    for p in res["passes"]:
        rows.append(f"| {p['order']} | {names[p['build']]} | {p['req_per_s']:.2f} | {fmt(p['latency_p50_ms'], '.0f')} "
                    f"| {fmt(p['latency_p95_ms'], '.0f')} | {fmt(p['mean_outstanding'], '.2f')} "
                    f"| {fmt(p['mean_waiting'], '.2f')} | {fmt(p['gpu_util_mean_pct'], '.0f')} "
                    f"| {fmt(p['gpu_mem_peak_mib'], '.0f')} | {p['failed']} | {p['golden_mismatches']} "
                    f"| {'yes' if p['valid'] else '**no**'} |")
    c = res["comparison"]
    verdict = (f"{names['B']} / {names['A']} throughput: **{c['b_over_a']:.2f}×**"
               + ("" if c["A"]["valid"] and c["B"]["valid"] else
                  " — **not a valid comparison**: a pass failed requests or changed the audio"))
    display(Markdown(f"### Workload *{workload}* ({res['items']} items, {protocol}), {concurrency} clients, "
                     f"{window_s:g} s windows after {fill_s:g} s fill\n\n" + "\n".join(rows) + "\n\n" + verdict))
    gpu_note = {p["gpu_error"] for p in res["passes"] if p["gpu_error"]}
    if gpu_note:
        print(f"{workload}: GPU not sampled ({', '.join(sorted(gpu_note))})")
    for p in res["passes"]:
        if p["errors"]:
            print(f"{workload}, pass {p['order']} failures:", p["errors"][:5])

# %%
fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 3.5), squeeze=False)
for ax, (workload, res) in zip(axes[0], results.items()):
    ps = res["passes"]
    ax.bar([f"{p['order']}: {names[p['build']]}" for p in ps], [p["req_per_s"] for p in ps],
           color=["tab:blue" if p["build"] == "A" else "tab:orange" for p in ps],
           hatch=["" if p["valid"] else "//" for p in ps])
    ax.set(title=f"sustained throughput per pass ({workload})", xlabel="pass: build", ylabel="items per second")
fig.tight_layout()
show(fig, out / "sustained.png")
