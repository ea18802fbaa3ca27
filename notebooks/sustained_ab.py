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
# Two server builds under the same sustained closed-loop load, in the order A, B, B, A. A pass is valid
# only if no request failed and every response after each client's warm-up matched the golden recording
# made alone on A with the same seed.

# %% tags=["parameters"]
url_a = "http://127.0.0.1:8000"
url_b = "http://127.0.0.1:8001"
label_a = "A"
label_b = "B"
workload = "plain"  # plain: one paragraph per request
prompts = ["Thanks for calling. Your order shipped this morning and should arrive on Friday."]
voice = "ryan"
seed = 7
max_frames = 120
concurrency = 4
fill_s = 10.0
window_s = 90.0
out_dir = "runs/sustained"

# %%
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from studies.sustained import sustained_ab

options = {"voice": voice, "seed": seed}
if max_frames:
    options["max_frames"] = max_frames
passes = sustained_ab(url_a, url_b, prompts, options, concurrency, fill_s, window_s)
names = {"A": label_a, "B": label_b}
(Path(out_dir) / "summary.json").write_text(json.dumps(
    {"workload": workload, "options": options, "concurrency": concurrency, "passes": passes}, indent=2, default=float))

# %%
rows = ["| pass | build | req/s | p50 latency ms | p95 latency ms | mean outstanding | mean waiting | failed "
        "| golden mismatches | valid |", "|" + "---|" * 10]
for p in passes:
    rows.append(f"| {p['order']} | {names[p['build']]} | {p['req_per_s']:.2f} | {p['latency_p50_ms']:.0f} "
                f"| {p['latency_p95_ms']:.0f} | {p['mean_outstanding']:.2f} | {p['mean_waiting']:.2f} | {p['failed']} "
                f"| {p['golden_mismatches']} | {'yes' if p['valid'] else '**no**'} |")
display(Markdown(f"Workload *{workload}*, {concurrency} clients, {window_s:g} s windows after {fill_s:g} s fill\n\n"
                 + "\n".join(rows)))

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.bar([f"{p['order']}: {names[p['build']]}" for p in passes], [p["req_per_s"] for p in passes],
       color=["tab:blue" if p["build"] == "A" else "tab:orange" for p in passes])
ax.set(title="sustained throughput per pass", ylabel="requests/s")
fig.tight_layout()
fig.savefig(Path(out_dir) / "sustained.png", dpi=100)
plt.show()
