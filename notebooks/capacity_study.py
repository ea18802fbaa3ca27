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
# # Capacity study
# The largest load at which one replica still meets every SLO (≥ 99% valid streams, p95 time to first
# audio ≤ 300 ms, p95 zero-buffer playback starvation ≤ 100 ms), the curves behind it, and the fleet a
# target load needs. Every stream is validated; an empty, malformed, non-finite or non-24 kHz stream fails.

# %% tags=["parameters"]
server_url = "http://127.0.0.1:8000"
mode = "closed"  # closed | open-fixed | open-poisson
protocol = "http"  # http (streamed POST /v1/audio/speech) | ws (one WebSocket utterance per request)
loads = [1, 2, 4, 8]  # requests in flight (closed) or requests/s (open)
requests_per_condition = 60
warmup = 2
corpus = "voice_agent"
voice = "ryan"
max_frames = 48  # cap per request (80 ms frames); None for the model's own end
chunk_schedule = [1, 2, 4]  # frames per streamed chunk, the last repeating
buffer_ms = 0.0  # client start-up buffer; 0 is the zero-buffer player the SLO is defined on
ttfa_p95_ms = 300.0
starvation_p95_ms = 100.0
min_success_rate = 0.99
target_load = 100.0  # fleet target, in the same unit as loads
price_per_hour = 1.0  # per replica, USD
label = ""
compare_url = ""  # optional second server (e.g. a serialised one) swept the same way, shown side by side
compare_label = "compare"
out_dir = "runs/capacity"

# %%
import json
from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from IPython.display import Markdown, display

from studies.corpora import load_corpus
from studies.fleet import fleet_size
from studies.records import read_jsonl
from studies.slo import SLO
from studies.sweep import sweep

out = Path(out_dir)
slo = SLO(min_success_rate, ttfa_p95_ms, starvation_p95_ms)
options = {"voice": voice, "seed": 0, "chunk_schedule": chunk_schedule}
if max_frames:
    options["max_frames"] = max_frames
servers = {label or server_url: (server_url, out)}
if compare_url:
    servers[compare_label] = (compare_url, out / "compare")
results = {name: sweep(url, mode, loads, requests_per_condition, load_corpus(corpus), d, options=options,
                       warmup=warmup, buffer_ms=buffer_ms, slo=slo, protocol=protocol)
           for name, (url, d) in servers.items()}
result = results[label or server_url]
conds = result["conditions"]
safe = result["safe_capacity"]

# %% [markdown]
# ## SLO table

# %%
def slo_table(conds):
    rows = ["| load | requests | success | 429 | TTFA p50 ms | TTFA p95 ms | starvation p95 ms | longest stall p95 ms "
            "| req/s | audio s/s | safe |", "|" + "---|" * 11]
    for c in conds:
        ok = c["slo"]
        rows.append(f"| {c['load']:g} | {c['requests']} | {c['success_rate']:.1%}{'' if ok['success'] else ' ✗'} "
                    f"| {c['rejected_429']} | {c['ttfa_p50_ms']:.0f} | {c['ttfa_p95_ms']:.0f}{'' if ok['ttfa'] else ' ✗'} "
                    f"| {c['starvation_p95_ms']:.0f}{'' if ok['starvation'] else ' ✗'} | {c['longest_stall_p95_ms']:.0f} "
                    f"| {c['throughput_rps']:.2f} | {c['audio_s_per_s']:.2f} | {'yes' if ok['safe'] else 'no'} |")
    return "\n".join(rows)


unit = "requests in flight" if mode == "closed" else "requests/s"
for name, r in results.items():
    display(Markdown(f"**{name}**, {mode} loop over {protocol}, buffer {buffer_ms:g} ms\n\n"
                     + slo_table(r["conditions"])
                     + f"\n\n**Safe capacity per replica ({name}): {r['safe_capacity']:g} {unit}**"))
    above = [c["load"] for c in r["conditions"] if c["slo"]["safe"] and c["load"] > r["safe_capacity"]]
    if above:
        display(Markdown(f"Note: load {', '.join(f'{a:g}' for a in above)} meets every SLO but a lower load does "
                         "not; a replica run below it would fail, so it is not counted as safe capacity."))
    for c in r["conditions"]:
        if c["errors"]:
            print(f"{name}, load {c['load']:g} failures:", c["errors"][:5])

# %% [markdown]
# ## TTFA, starvation and throughput against load

# %%
fig, axes = plt.subplots(1, 3, figsize=(15, 4))
for name, r in results.items():
    cs = r["conditions"]
    x = [c["load"] for c in cs]
    axes[0].plot(x, [c["ttfa_p95_ms"] for c in cs], "s-", label=f"{name} p95")
    axes[0].plot(x, [c["ttfa_p50_ms"] for c in cs], "o--", label=f"{name} p50")
    axes[1].plot(x, [c["starvation_p95_ms"] for c in cs], "s-", label=f"{name} p95")
    axes[1].plot(x, [c["starvation_p50_ms"] for c in cs], "o--", label=f"{name} p50")
    axes[2].plot(x, [c["throughput_rps"] for c in cs], "s-", label=f"{name} valid req/s")
    axes[2].plot(x, [c["audio_s_per_s"] for c in cs], "o--", label=f"{name} audio s/s")
axes[0].axhline(ttfa_p95_ms, color="red", ls=":", label="SLO p95")
axes[0].set(title="time to first audio", xlabel=unit, ylabel="ms")
axes[1].axhline(starvation_p95_ms, color="red", ls=":", label="SLO p95")
axes[1].set(title=f"playback starvation (buffer {buffer_ms:g} ms)", xlabel=unit, ylabel="ms")
axes[2].set(title="throughput", xlabel=unit)
for ax in axes:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.legend(fontsize="small")
fig.tight_layout()
fig.savefig(out / "curves.png", dpi=100)
plt.show()

# %%
records = [r for r in read_jsonl(out / "records.jsonl") if not r.warmup and r.ok]
fig, ax = plt.subplots(figsize=(7, 4))
for load in [c["load"] for c in conds]:
    ax.ecdf([1000 * r.ttfa_s for r in records if r.load == load], label=f"load {load:g}")
ax.axvline(ttfa_p95_ms, color="red", ls="--")
ax.set(title=f"TTFA distribution ({label or server_url})", xlabel="ms", ylabel="fraction of requests")
ax.legend()
fig.savefig(out / "ttfa_cdf.png", dpi=100)
plt.show()

# %% [markdown]
# ## Fleet sizing

# %%
if safe > 0:
    fleet = fleet_size(safe, target_load, price_per_hour)
    display(Markdown(
        f"Target {target_load:g} {unit} at {safe:g} per replica, ${price_per_hour:g}/h per replica:\n\n"
        "| policy | replicas | $/hour | $/month |\n|---|---|---|---|\n"
        + "".join(f"| {name} | {fleet[key]['replicas']} | {fleet[key]['per_hour']:.2f} | {fleet[key]['per_month']:.0f} |\n"
                  for name, key in (("40% headroom: ceil(target / safe × 1.4)", "headroom_40"),
                                    ("60% utilisation: ceil(target / safe / 0.6)", "utilisation_60")))))
else:
    fleet = None
    display(Markdown("**No tested load met every SLO, so no fleet size can be derived.** Try lower loads, "
                     "a start-up buffer, or a smaller first chunk."))
summary = json.loads((out / "summary.json").read_text())
summary["fleet"] = fleet
(out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
