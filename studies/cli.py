"""`python -m studies`: `capacity` (sweep + HTML report, against a URL or a local server it starts),
`sustained` (A/B of two builds under sustained load, golden-checked), `fleet` (replicas and cost for a
target load) and `explore` (one synthesis to listen to and look at)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from studies.fleet import DEFAULT_PRICE_PER_HOUR, fleet_size

PRICE_HELP = (f"USD per replica-hour (default {DEFAULT_PRICE_PER_HOUR:g}: a placeholder, and the output says so; "
              "give your accelerator's price)")


class _Help(argparse.HelpFormatter):
    """Adds "(default: X)" to a flag's help once, unless the help already names its default or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def request_options(args) -> dict:
    """The speech request's fields every measured request carries (`--chunk-schedule` given empty: none, so the
    server streams at its own schedule)."""
    return {"voice": "ryan", "seed": 0, "max_frames": args.max_frames,
            **({"chunk_schedule": args.chunk_schedule} if args.chunk_schedule else {})}


def build_parser(prog: str = "python -m studies") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="capacity studies of a qtts-jax speech server")
    sub = p.add_subparsers(dest="command", required=True)
    defaults = {"formatter_class": _Help}  # every flag's help shows its default, once
    f = sub.add_parser("fleet", help="replicas and cost for a target load", **defaults)
    f.add_argument("--safe-capacity", type=float, required=True, help="one replica's safe capacity")
    f.add_argument("--target", type=float, required=True, help="target load, same unit as the safe capacity")
    f.add_argument("--price-per-hour", type=float, help=PRICE_HELP)
    c = sub.add_parser("capacity", help="sweep one or two servers, judge the SLOs, write runs/<id>/report.html",
                       **defaults)
    c.add_argument("--url", help="server to study (default: start a local tiny-random server on 127.0.0.1)")
    c.add_argument("--serialised", action="store_true", help="local server: one stream at a time")
    c.add_argument("--compare-url", help="a second server swept the same way and shown side by side")
    c.add_argument("--compare-serialised", action="store_true",
                   help="compare with a local serialised server (one stream at a time) started for the study")
    c.add_argument("--slots", type=int, default=2, help="local server: concurrent streams it batches")
    c.add_argument("--model", default="tiny-random", help="local server: checkpoint directory or tiny-random")
    c.add_argument("--mode", default="closed", choices=["closed", "open-fixed", "open-poisson"],
                   help="closed: LOAD clients, each offering one stream at a time and waiting out a refusal's Retry-After; "
                        "open-*: LOAD requests/s, evenly spaced or Poisson")
    c.add_argument("--protocol", default="http", choices=["http", "ws"],
                   help="http: streamed POST /v1/audio/speech; ws: one WebSocket utterance per request")
    c.add_argument("--loads", type=float, nargs="+", default=[1, 2, 4], metavar="LOAD",
                   help="loads to sweep: clients (closed) or requests/s (open)")
    c.add_argument("--requests", type=int, default=60,
                   help="measured requests per load (a closed loop measures one a client at least); 59 or more "
                        "bound a p95 from above, so fewer can never pass")
    c.add_argument("--warmup", type=int, default=2, help="unmeasured requests at the start of each load")
    c.add_argument("--max-frames", type=int, default=24, help="frames (80 ms) per request")
    c.add_argument("--chunk-schedule", type=int, nargs="*", default=[1, 2, 4], metavar="FRAMES",
                   help="frames per streamed chunk, the last repeating; given with none, the server's own schedule "
                        "(a GPU server's capacity is measured at its own)")
    c.add_argument("--buffer-ms", type=float, default=0.0,
                   help="client start-up buffer of the simulated player (the SLO is defined at 0)")
    c.add_argument("--contract-ttfa-ms", type=float, default=100.0,
                   help="zero-underrun contract, judged beside the SLO: p95 TTFA target; the contract also needs "
                        "every request to succeed and no stream to stall after its first audio at zero buffer")
    c.add_argument("--target", type=float, default=100.0, help="fleet sizing: load to carry, in the loads' unit")
    c.add_argument("--price-per-hour", type=float, help="fleet sizing: " + PRICE_HELP)
    c.add_argument("--runs-dir", default="runs", help="parent directory of the run directory")
    c.add_argument("--no-report", action="store_true",
                   help="measure only (records and summary.json), for a machine without papermill such as a GPU "
                        "host; render the report anywhere with `report RUN_DIR`")
    r = sub.add_parser("report", help="render report.html from a capacity or sustained run measured with "
                                      "--no-report (or again)", **defaults)
    r.add_argument("run_dir", help="the run directory: its summary.json and records")
    s = sub.add_parser("sustained", help="A/B of two builds under sustained load: passes A, B, B, A per workload, "
                                         "golden-checked; runs notebooks/sustained_ab.py -> runs/<id>/report.html",
                       **defaults)
    s.add_argument("--url", help="build A, the reference the goldens are recorded on "
                                 "(default: start a local tiny-random server on 127.0.0.1)")
    s.add_argument("--compare-url", help="build B (default: A again, an A/A run that shows the noise)")
    s.add_argument("--compare-serialised", action="store_true",
                   help="build B is a local serialised server (one stream at a time) started for the study")
    s.add_argument("--label-a", help="name of build A in the report (default: its URL)")
    s.add_argument("--label-b", help="name of build B in the report (default: its URL)")
    s.add_argument("--slots", type=int, default=4, help="local server: concurrent streams")
    s.add_argument("--context", type=int, default=1024,
                   help="local server: KV rows per slot (prompts up to a quarter of it: paragraphs need room)")
    s.add_argument("--model", default="tiny-random", help="local server: checkpoint directory or tiny-random")
    s.add_argument("--workload", nargs="+", choices=["plain", "processed"], default=["plain", "processed"],
                   help="plain: one paragraph per request; processed: two turns as one SSML request (a "
                        "120 ms break, prosody), normalised")
    s.add_argument("--items", type=int, default=0, help="items per workload from its corpus (0: all)")
    s.add_argument("--plain-corpus", default="sustained_plain",
                   help="corpus name or .txt path, one paragraph per line")
    s.add_argument("--processed-corpus", default="sustained_processed",
                   help="corpus name or .txt path, two turns per line separated by ' | '")
    s.add_argument("--protocol", default="http", choices=["http", "ws"],
                   help="http: streamed POST /v1/audio/speech; ws: one WebSocket utterance per request")
    s.add_argument("--concurrency", type=int, default=4, help="clients, each replacing its item when it completes")
    s.add_argument("--fill-s", type=float, default=10.0,
                   help="load before timing starts (and at least until every client's warm-up item is done)")
    s.add_argument("--window-s", type=float, default=90.0, help="steady window per pass")
    s.add_argument("--max-frames", type=int, help="cap per request (default: the model's own end)")
    s.add_argument("--voice", default="ryan", help="a speaker, an OpenAI voice name or a registered voice")
    s.add_argument("--seed", type=int, default=7, help="fixed seed: every response must match its golden")
    s.add_argument("--pause-ms", type=float, default=120.0, help="processed: silence between the turns")
    s.add_argument("--no-gpu", action="store_true", help="do not sample nvidia-smi")
    s.add_argument("--gpu-ids", default="", help="nvidia-smi -i (e.g. 0); default every GPU")
    s.add_argument("--no-report", action="store_true",
                   help="measure only (records and summary.json), for a machine without papermill such as a GPU "
                        "host; render the report anywhere with `report RUN_DIR`")
    s.add_argument("--runs-dir", default="runs", help="parent directory of the run directory")
    e = sub.add_parser("explore", help="one synthesis through a server: listen, waveform, spectrogram, where the "
                                       "time to first audio goes; runs notebooks/explore_model.py -> "
                                       "runs/<id>/report.html", **defaults)
    e.add_argument("--url", help="a running server (default: start a local one on --model for the one request)")
    e.add_argument("--model", default="tiny-random", help="local server: checkpoint directory or tiny-random")
    e.add_argument("--text", default="Hi, how can I help you today?", help="what to say")
    e.add_argument("--voice", default="alloy", help="a speaker, an OpenAI voice name or a registered voice "
                                                    "(default alloy, the server's default voice)")
    e.add_argument("--seed", type=int, default=0, help="sampling seed")
    e.add_argument("--max-frames", type=int, default=48,
                   help="cap on 80 ms frames (0: the model's own end; random weights rarely end)")
    e.add_argument("--runs-dir", default="runs", help="parent directory of the run directory")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m studies") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.command == "fleet":
        price = DEFAULT_PRICE_PER_HOUR if args.price_per_hour is None else args.price_per_hour
        try:
            fleet = fleet_size(args.safe_capacity, args.target, price)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        for name, key in (("40% headroom", "headroom_40"), ("60% utilisation", "utilisation_60")):
            f = fleet[key]
            print(f"{name}: {f['replicas']} replicas, ${f['per_hour']:.2f}/h, ${f['per_month']:.0f}/month")
        if args.price_per_hour is None:
            print(f"(at the placeholder price ${price:g} per replica-hour: pass --price-per-hour)")
        return 0
    if args.command == "sustained":
        return sustained(args)
    if args.command == "explore":
        return explore(args)
    if args.command == "report":
        return render_report(args)
    return capacity(args)


def explore(args) -> int:
    from studies.report import new_run_dir, run_notebook

    run_dir = new_run_dir(args.runs_dir, "explore")
    print(f"explore: {args.url or f'a local {args.model} server'} -> {run_dir}", file=sys.stderr)
    report = run_notebook("explore_model", {"server_url": args.url or "", "model": args.model, "text": args.text,
                                            "voice": args.voice, "seed": args.seed, "max_frames": args.max_frames},
                          run_dir)
    print(f"audio: {run_dir / 'speech.wav'}; report: {report}")
    return 0


def capacity(args) -> int:
    """Starts the local servers asked for, measures here (progress on the terminal), then renders the report
    from the summary with notebooks/capacity_study.py."""
    from studies.capacity import study
    from studies.corpora import load_corpus
    from studies.report import new_run_dir, run_notebook
    from studies.server import local_server
    from studies.slo import SLO, Contract
    from studies.verdict import batching_text, contract_text, last_line, machine_text, scaling_text, verdict_text

    if args.compare_url and args.compare_serialised:
        print("error: give --compare-url or --compare-serialised, not both", file=sys.stderr)
        return 2
    try:
        contract = Contract(args.contract_ttfa_ms)
    except ValueError as exc:
        print(f"error: --contract-ttfa-ms: {exc}", file=sys.stderr)
        return 2
    run_dir = new_run_dir(args.runs_dir, "capacity" + ("-serialised" if args.serialised else ""))
    loads = [int(x) if args.mode == "closed" else x for x in args.loads]
    options = request_options(args)
    local = {"model": args.model, "context": 256, "frames_per_step": 1}  # local_server's defaults
    with contextlib.ExitStack() as stack:
        servers, configs = {}, {}
        if args.url:
            servers[args.url] = args.url
        else:
            label = f"local {args.model}, {'serialised' if args.serialised else f'{args.slots} slots'}"
            servers[label] = stack.enter_context(local_server(args.model, slots=args.slots, serialised=args.serialised,
                                                              log_path=run_dir / "server.log"))
            configs[label] = {**local, "slots": 1 if args.serialised else args.slots, "serialised": args.serialised}
        if args.compare_url:
            servers[args.compare_url] = args.compare_url
        elif args.compare_serialised:
            label = f"local {args.model}, serialised"
            servers[label] = stack.enter_context(local_server(args.model, serialised=True,
                                                              log_path=run_dir / "server-serialised.log"))
            configs[label] = {**local, "slots": 1, "serialised": True}
        print(f"studying {', '.join(servers.values())} -> {run_dir}", file=sys.stderr)
        summary = study(servers, run_dir, args.mode, loads, args.requests, load_corpus("voice_agent"), options,
                        args.warmup, args.buffer_ms, SLO(), args.protocol, args.target, args.price_per_hour, configs,
                        contract)
    report = "not rendered: python -m studies report " + str(run_dir) if args.no_report else run_notebook(
        "capacity_study", {"measured": True}, run_dir)
    for server in summary["servers"]:
        print(verdict_text(server, summary).replace("**", ""), end="\n\n")
        print(contract_text(server, summary).replace("**", ""), end="\n\n")
        print(scaling_text(server).replace("**", ""), end="\n\n")
    for text in (batching_text(summary), machine_text(summary)):
        if text:
            print(text.replace("**", ""), end="\n\n")
    print(last_line(summary, report))
    return 0


def render_report(args) -> int:
    """The report of a capacity study or a sustained A/B measured elsewhere: its notebook draws it from the run's
    own files."""
    from studies.report import run_notebook

    run_dir = Path(args.run_dir)
    if not (run_dir / "summary.json").is_file():
        print(f"error: {run_dir / 'summary.json'} not found: give a capacity or sustained run directory",
              file=sys.stderr)
        return 2
    kind = json.loads((run_dir / "summary.json").read_text()).get("kind")
    notebook = "sustained_ab" if kind == "sustained" else "capacity_study"
    print(f"report: {run_notebook(notebook, {'measured': True}, run_dir)}")
    return 0


def _fmt(v, spec: str) -> str:
    """format(v, spec), or "n/a" in the same width for None/NaN."""
    width = int("".join(c for c in spec.split(".")[0] if c.isdigit()) or 0)
    return "n/a".rjust(width) if v is None or v != v else format(v, spec)


def sustained(args) -> int:
    from studies.report import new_run_dir, run_notebook
    from studies.server import local_server
    from studies.sustained import measure

    if args.compare_url and args.compare_serialised:
        print("error: give --compare-url or --compare-serialised, not both", file=sys.stderr)
        return 2
    if args.concurrency < 1 or args.window_s <= 0 or args.fill_s < 0:
        print("error: need --concurrency >= 1, --window-s > 0, --fill-s >= 0", file=sys.stderr)
        return 2
    run_dir = new_run_dir(args.runs_dir, "sustained")
    with contextlib.ExitStack() as stack:
        url_a = args.url or stack.enter_context(local_server(args.model, slots=args.slots, context=args.context,
                                                             log_path=run_dir / "server.log"))
        url_b = args.compare_url or (stack.enter_context(local_server(
            args.model, serialised=True, context=args.context, log_path=run_dir / "server-serialised.log"))
            if args.compare_serialised else url_a)
        label_a = args.label_a or args.url or f"local {args.model}, {args.slots} slots"
        label_b = args.label_b or args.compare_url or (
            f"local {args.model}, serialised" if args.compare_serialised else f"{label_a} (again)")
        print(f"sustained A/B: A = {url_a}, B = {url_b} -> {run_dir}", file=sys.stderr)
        summary = measure(run_dir, url_a, url_b, label_a, label_b, args.workload,
                          {"plain": args.plain_corpus, "processed": args.processed_corpus}, args.items, args.voice,
                          args.seed, args.max_frames, args.concurrency, args.fill_s, args.window_s, args.protocol,
                          args.pause_ms, not args.no_gpu, args.gpu_ids or None)
    report = ("not rendered: python -m studies report " + str(run_dir) if args.no_report
              else run_notebook("sustained_ab", {"measured": True}, run_dir))
    names = {"A": label_a, "B": label_b}
    print("workload   pass build  req/s  p50 ms  p95 ms  outst.  wait  GPU%  GPU MiB  failed  mismatch  valid")
    for workload, res in summary["workloads"].items():
        for p in res["passes"]:
            print(f"{workload:<10} {p['order']:>4} {p['build']:>5} {p['req_per_s']:>6.2f} "
                  f"{_fmt(p['latency_p50_ms'], '7.0f')} {_fmt(p['latency_p95_ms'], '7.0f')} "
                  f"{_fmt(p['mean_outstanding'], '7.2f')} {_fmt(p['mean_waiting'], '5.2f')} "
                  f"{_fmt(p['gpu_util_mean_pct'], '5.0f')} {_fmt(p['gpu_mem_peak_mib'], '8.0f')} "
                  f"{p['failed']:>7} {p['golden_mismatches']:>9}  {'yes' if p['valid'] else 'NO'}")
        c = res["comparison"]
        ok = c["A"]["valid"] and c["B"]["valid"]
        print(f"{workload}: B/A throughput {_fmt(c['b_over_a'], '.2f')}x ({names['B']} vs {names['A']})"
              f"{'' if ok else ' -- not valid: a pass failed requests or changed the audio'}")
    print(f"report: {report}")
    valid = all(c["comparison"][b]["valid"] for c in summary["workloads"].values() for b in ("A", "B"))
    return 0 if valid else 1
