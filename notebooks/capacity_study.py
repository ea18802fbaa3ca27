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
# The largest load at which one replica meets every SLO (≥ 99% valid streams, p95 time to first audio
# ≤ 300 ms, p95 zero-buffer playback starvation ≤ 100 ms) with confidence, the curves behind it, and the fleet
# a target load needs. A p95 passes only if its 95% upper confidence bound (order statistics, no assumed
# distribution) meets the target and fails only if its 95% lower bound misses it; otherwise the load is
# undecided and not counted. Every stream is validated; an empty, malformed, non-finite or non-24 kHz stream fails.
# Beside the SLO, never instead of it, the field's zero-underrun contract: every request succeeds (a 429 is a
# failure), no stream stalls after its first audio at a zero-buffer player, and p95 TTFA meets its own target
# (default 100 ms) with confidence; its zero-underrun capacity is counted the same way. The fleet is sized on
# the SLO's safe capacity.

# %% tags=["parameters"]
server_url = "http://127.0.0.1:8000"
mode = "closed"  # closed | open-fixed | open-poisson
protocol = "http"  # http (streamed POST /v1/audio/speech) | ws (one WebSocket utterance per request)
loads = [1, 2, 4, 8]  # clients (closed) or requests/s (open)
requests_per_condition = 60  # 59 or more: fewer cannot bound a p95 from above, so no load can pass
warmup = 2
corpus = "voice_agent"
voice = "ryan"
max_frames = 48  # cap per request (80 ms frames); None for the model's own end
chunk_schedule = [1, 2, 4]  # frames per streamed chunk, the last repeating
buffer_ms = 0.0  # client start-up buffer; 0 is the zero-buffer player the SLO is defined on
ttfa_p95_ms = 300.0
starvation_p95_ms = 100.0
min_success_rate = 0.99
contract_ttfa_p95_ms = 100.0  # zero-underrun contract's TTFA target
target_load = 100.0  # fleet target, in the same unit as loads
price_per_hour = None  # per replica, USD; None: the placeholder default, which the report names
label = ""
compare_url = ""  # optional second server (e.g. a serialised one) swept the same way, shown side by side
compare_label = "compare"
measured = False  # True: out_dir already holds this study's summary.json (the CLI measured); only draw it
out_dir = "runs/capacity"

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt  # noqa: F401  (inline backend in Jupyter and papermill)
import pandas as pd
from IPython.display import Markdown, display

from studies.capacity import study
from studies.corpora import load_corpus
from studies.plots import capacity_curves, show, ttfa_cdfs
from studies.records import read_jsonl
from studies.slo import SLO, Contract
from studies.verdict import (batching_text, conditions_table, contract_text, fleet_text, machine_text, provenance_table,
                             scaling_table, scaling_text, verdict_text)

pd.set_option("display.max_colwidth", None)  # provenance values are long; never cut them to "..."
out = Path(out_dir)
if measured:
    summary = json.loads((out / "summary.json").read_text())
else:
    options = {"voice": voice, "seed": 0, "chunk_schedule": chunk_schedule}
    if max_frames:
        options["max_frames"] = max_frames
    servers = {label or server_url: server_url}
    if compare_url:
        servers[compare_label] = compare_url
    summary = study(servers, out, mode, loads, requests_per_condition, load_corpus(corpus), options, warmup,
                    buffer_ms, SLO(min_success_rate, ttfa_p95_ms, starvation_p95_ms), protocol, target_load,
                    price_per_hour, contract=Contract(contract_ttfa_p95_ms))
opts = summary["options"]
display(Markdown(f"{summary['mode']} loop over {summary['protocol']}, {summary['requests_per_condition']} measured "
                 f"requests per load after {summary['warmup']} warm-up; {opts.get('max_frames', 'model-decided')} "
                 f"frames per request in chunks of {opts.get('chunk_schedule')} frames; start-up buffer "
                 f"{summary['buffer_ms']:g} ms; run `{summary['provenance']['run_id']}`"))

# %% [markdown]
# ## SLO table and verdict
# TTFA and starvation p95 with their 90% confidence intervals; ✗ the interval is above the target, ? it
# contains the target (undecided). `refused`: requests the server never admitted, even after waiting out its
# Retry-After twice; `admitted after a refusal`: requests whose wait for that is in their TTFA. Streams that underran: valid streams with any stall after their first audio
# at zero buffer, with the share's exact binomial (Clopper-Pearson) 90% interval; `zero-underrun` is the
# contract's verdict.

# %%
if warning := machine_text(summary):
    display(Markdown(warning))
for server in summary["servers"]:
    display(Markdown(f"### {server['label']}"))
    display(conditions_table(server))
    display(Markdown(verdict_text(server, summary)))
    display(Markdown(contract_text(server, summary)))
    for c in server["conditions"]:
        if c["errors"]:
            display(Markdown(f"Load {c['load']:g} failures: " + "; ".join(f"`{e}`" for e in c["errors"][:5])))

# %% [markdown]
# ## TTFA, starvation and throughput against load

# %%
show(capacity_curves(summary), out / "curves.png")
if batching := batching_text(summary):
    display(Markdown(batching))

# %% [markdown]
# ## TTFA distribution per server

# %%
show(ttfa_cdfs(summary, read_jsonl(out / "records.jsonl")), out / "ttfa_cdf.png")

# %% [markdown]
# ## Fleet sizing

# %%
for server in summary["servers"]:
    display(Markdown(fleet_text(server, summary)))

# %% [markdown]
# ## What to scale on
# While each load ran, the study scraped the server's `/metrics` every half second (`samples.jsonl`) and counted
# its own streams in flight and still playing. Per signal: its median at the last load that meets the SLO (with
# every lower load) and at the first load above it that fails, their separation in units of the signal's spread
# within a load, and the threshold (the passing load's upper quartile; lower quartile for a signal that falls).
# The signal that separates the two loads most is the one to scale on.

# %%
for server in summary["servers"]:
    if "scale_signal" not in server:  # a summary written before the study sampled /metrics
        display(Markdown(f"**{server['label']}**: not sampled (this run predates the /metrics sampler)."))
        continue
    display(Markdown(scaling_text(server)))
    display(scaling_table(server["scale_signal"]["slo"]))

# %% [markdown]
# ## Provenance
# Per-request records with derived `ttfa_ms`, `starvation_ms`, `underruns` and `audio_s` are in
# `records.jsonl` (`pandas.read_json(path, lines=True)`); this block is `provenance` in `summary.json`.

# %%
display(provenance_table(summary))
