"""`python -m studies`: `capacity` (sweep + HTML report, against a URL or a local server it starts) and
`fleet` (replicas and cost for a target load)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from studies.fleet import fleet_size


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m studies", description="capacity studies of a qtts-jax speech server")
    sub = p.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fleet", help="replicas and cost for a target load")
    f.add_argument("--safe-capacity", type=float, required=True, help="one replica's safe capacity")
    f.add_argument("--target", type=float, required=True, help="target load, same unit as the safe capacity")
    f.add_argument("--price-per-hour", type=float, default=0.0, help="per replica")
    c = sub.add_parser("capacity", help="run notebooks/capacity_study.py and write runs/<id>/report.html")
    c.add_argument("--url", help="server to study (default: start a local tiny-random server on 127.0.0.1)")
    c.add_argument("--serialised", action="store_true", help="local server: one stream at a time")
    c.add_argument("--compare-url", help="a second server swept the same way and shown side by side")
    c.add_argument("--compare-serialised", action="store_true",
                   help="compare with a local serialised server (one stream at a time) started for the study")
    c.add_argument("--slots", type=int, default=4, help="local server: concurrent streams")
    c.add_argument("--model", default="tiny-random", help="local server: checkpoint directory or tiny-random")
    c.add_argument("--mode", default="closed", choices=["closed", "open-fixed", "open-poisson"])
    c.add_argument("--protocol", default="http", choices=["http", "ws"],
                   help="http: streamed POST /v1/audio/speech; ws: one WebSocket utterance per request")
    c.add_argument("--loads", type=float, nargs="+", default=[1, 2, 4, 8])
    c.add_argument("--requests", type=int, default=60, help="measured requests per condition")
    c.add_argument("--warmup", type=int, default=2)
    c.add_argument("--max-frames", type=int, default=48)
    c.add_argument("--buffer-ms", type=float, default=0.0)
    c.add_argument("--target", type=float, default=100.0)
    c.add_argument("--price-per-hour", type=float, default=1.0)
    c.add_argument("--runs", default="runs", help="parent directory of the run directory")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "fleet":
        try:
            fleet = fleet_size(args.safe_capacity, args.target, args.price_per_hour)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for name, key in (("40% headroom", "headroom_40"), ("60% utilisation", "utilisation_60")):
            f = fleet[key]
            print(f"{name}: {f['replicas']} replicas, ${f['per_hour']:.2f}/h, ${f['per_month']:.0f}/month")
        return 0
    from studies.report import new_run_dir, run_notebook
    from studies.server import local_server

    if args.compare_url and args.compare_serialised:
        print("error: give --compare-url or --compare-serialised, not both", file=sys.stderr)
        return 2
    run_dir = new_run_dir(args.runs, "capacity" + ("-serialised" if args.serialised else ""))
    loads = [int(x) if args.mode == "closed" else x for x in args.loads]
    with contextlib.ExitStack() as stack:
        url = args.url or stack.enter_context(local_server(args.model, slots=args.slots, serialised=args.serialised,
                                                           log_path=run_dir / "server.log"))
        compare_url = args.compare_url or (stack.enter_context(local_server(
            args.model, serialised=True, log_path=run_dir / "server-serialised.log")) if args.compare_serialised else "")
        print(f"studying {url}{f' and {compare_url}' if compare_url else ''} -> {run_dir}", file=sys.stderr)
        report = run_notebook("capacity_study", {
            "server_url": url, "mode": args.mode, "protocol": args.protocol, "loads": loads,
            "requests_per_condition": args.requests,
            "warmup": args.warmup, "max_frames": args.max_frames, "buffer_ms": args.buffer_ms,
            "target_load": args.target, "price_per_hour": args.price_per_hour,
            "label": args.url or f"local {args.model}, {'serialised' if args.serialised else f'{args.slots} slots'}",
            "compare_url": compare_url,
            "compare_label": args.compare_url or f"local {args.model}, serialised",
        }, run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"safe capacity: {summary['safe_capacity']:g}; report: {report}")
    return 0
