"""The capacity report's figures, drawn from summary.json and the records: one colour per server, one panel
per unit, loads on integer ticks, SLO lines in the legend. `show` saves a PNG and puts the figure inline."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from studies.capacity import unit


def colours(n: int) -> list:
    return [plt.get_cmap("tab10")(i) for i in range(n)]


def _load_axis(ax, loads: list[float], mode: str) -> None:
    """Log-2 load axis ticked exactly at the loads tried, labelled 1, 2, 4 (never 1.0 or 10^0)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(loads, [f"{x:g}" for x in loads])
    ax.minorticks_off()
    ax.set_xlabel(f"load ({unit(mode)})")


def capacity_curves(summary: dict):
    """Four panels: p95 (solid, with its confidence interval as error bars) and p50 (dashed) TTFA in ms;
    p95 starvation in ms; valid requests/s; audio seconds delivered per wall second."""
    mode, slo, loads = summary["mode"], summary["slo"], summary["loads"]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for colour, s in zip(colours(len(summary["servers"])), summary["servers"]):
        cs = s["conditions"]
        x = np.array([c["load"] for c in cs], float)
        for ax, key in ((axes[0], "ttfa"), (axes[1], "starvation")):
            p95 = np.array([c[f"{key}_p95_ms"] for c in cs])
            lo, hi = np.array([c[f"{key}_p95_ci_ms"] for c in cs]).T
            with np.errstate(invalid="ignore"):  # no valid stream (NaN) or an unbounded side: no bar that way
                err = np.nan_to_num([p95 - lo, hi - p95], nan=0, posinf=0, neginf=0).clip(0)
            ax.errorbar(x, p95, yerr=err, fmt="s-", color=colour, capsize=3, label=f"{s['label']} p95 (90% CI)")
            ax.plot(x, [c[f"{key}_p50_ms"] for c in cs], "o--", color=colour, alpha=0.7, label=f"{s['label']} p50")
        axes[2].plot(x, [c["throughput_rps"] for c in cs], "s-", color=colour, label=s["label"])
        axes[3].plot(x, [c["audio_s_per_s"] for c in cs], "s-", color=colour, label=s["label"])
    axes[0].axhline(slo["ttfa_p95_ms"], color="red", ls=":", label=f"SLO: p95 ≤ {slo['ttfa_p95_ms']:g} ms")
    axes[1].axhline(slo["starvation_p95_ms"], color="red", ls=":",
                    label=f"SLO: p95 ≤ {slo['starvation_p95_ms']:g} ms")
    axes[0].set(title="time to first audio", ylabel="TTFA (ms)")
    axes[1].set(title=f"playback starvation, {summary['buffer_ms']:g} ms buffer", ylabel="starvation per stream (ms)")
    axes[2].set(title="throughput", ylabel="valid requests per second (req/s)")
    axes[3].set(title="audio delivered", ylabel="audio seconds per wall second (s/s)")
    for ax in axes:
        _load_axis(ax, loads, mode)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def ttfa_cdfs(summary: dict, records: list) -> plt.Figure:
    """One panel per server: the TTFA distribution of valid measured streams at each load, SLO line marked."""
    servers = summary["servers"]
    fig, axes = plt.subplots(1, len(servers), figsize=(6.5 * len(servers), 4), squeeze=False, sharey=True)
    loads = summary["loads"]
    shades = plt.get_cmap("viridis")(np.linspace(0, 0.85, len(loads)))
    for ax, s in zip(axes[0], servers):
        for shade, load in zip(shades, loads):
            ttfa = [1000 * r.ttfa_s for r in records if r.server == s["label"] and r.load == load
                    and r.ok and not r.warmup]
            if ttfa:
                ax.ecdf(ttfa, color=shade, label=f"load {load:g}")
        ax.axvline(summary["slo"]["ttfa_p95_ms"], color="red", ls=":",
                   label=f"SLO: p95 ≤ {summary['slo']['ttfa_p95_ms']:g} ms")
        ax.axhline(0.95, color="grey", lw=0.8, label="95% of streams (p95)")
        ax.set(title=s["label"], xlabel="TTFA (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="lower right")
    axes[0][0].set_ylabel("fraction of streams")
    fig.tight_layout()
    return fig


def show(fig, path: str | Path) -> None:
    """Saves the figure as a PNG beside the report and displays it inline (in Jupyter and in report.html)."""
    from IPython.display import display

    fig.savefig(path, dpi=100)
    display(fig)
    plt.close(fig)
