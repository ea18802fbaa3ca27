"""`qtts-jax cluster`: a local Ray instance (or the one RAY_ADDRESS names) serving the speech API from N engine
replicas; the server's flags set every replica's engine and admission."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import sys
import time

log = logging.getLogger("fleet")
APP = "qtts"


def add_cluster_parser(sub) -> argparse.ArgumentParser:
    from serving.cli import add_server_flags

    c = sub.add_parser("cluster", help="serve the same API from a Ray Serve fleet of engine replicas (fleet extra)",
                       description="Starts a local Ray instance (or joins RAY_ADDRESS) and serves the speech API "
                                   "from engine replicas behind a stream-aware router. The server's flags (and "
                                   "QTTS_* variables) set each replica; --host/--port are where the fleet listens.")
    add_server_flags(c)
    c.add_argument("--replicas", type=int, default=1, help="engine replicas (the initial count when autoscaling; "
                                                           "default 1)")
    c.add_argument("--min-replicas", type=int, help="autoscale on live streams, down to this many (default: no "
                                                    "autoscaling; 1 when only --max-replicas is given)")
    c.add_argument("--max-replicas", type=int, help="autoscale up to this many (default: no autoscaling; "
                                                    "--replicas when only --min-replicas is given)")
    c.add_argument("--safe-capacity", type=float, help="streams one replica carries within the SLOs, from "
                                                       "`qtts-jax study capacity` (default: its slots)")
    c.add_argument("--scale-from", metavar="SUMMARY", help="a capacity study's summary.json: the safe capacity is "
                                                          "the threshold of the signal it chose to scale on, or its "
                                                          "safe capacity (docs/fleet.md)")
    c.add_argument("--headroom", type=float, default=0.4, help="warm capacity kept beyond the live streams: each "
                                                               "replica aims at safe / (1 + headroom) (default 0.4)")
    c.add_argument("--gpus-per-replica", type=float, help="GPUs each replica takes (default: 1 when Ray sees a "
                                                          "GPU, else 0: CPU replicas)")
    c.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs Ray reserves per replica (default 1)")
    return c


def cluster(args) -> int:
    """Run until SIGTERM/SIGINT, then shut the application down (replicas drain their streams first)."""
    if importlib.util.find_spec("ray") is None:
        print("error: qtts-jax cluster needs the fleet extra (Ray Serve): pip install -e '.[fleet]', or "
              "make cluster, which installs it and starts a fleet", file=sys.stderr)
        return 2
    import ray
    from ray import serve

    from fleet.app import RAY_ENV, FleetConfig, build, safe_capacity_from
    from serving.cli import settings_from_args

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    safe = args.safe_capacity
    if args.scale_from:
        if safe is not None:
            log.error("not starting: give --safe-capacity or --scale-from, not both")
            return 2
        try:
            safe, why = safe_capacity_from(args.scale_from)
        except (OSError, ValueError) as exc:
            log.error("not starting: %s", exc)
            return 2
        log.info("safe capacity %g streams per replica, from %s", safe, why)
    settings = settings_from_args(args)
    for name, value in RAY_ENV.items():  # before Ray starts, so its processes inherit them
        os.environ.setdefault(name, value)
    if not os.environ.get("RAY_ADDRESS"):
        # CPU replicas on a small machine: room for every replica however few cores Ray counts
        cpus = max(os.cpu_count() or 1, int(args.cpus_per_replica * max(args.replicas, args.max_replicas or 0)) + 1)
        ray.init(num_cpus=cpus, include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(logging_level=logging.WARNING)
    gpus = args.gpus_per_replica
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    fleet = FleetConfig(replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                        safe_capacity=safe, headroom=args.headroom, gpus=gpus,
                        cpus=args.cpus_per_replica)
    try:
        app = build(settings, fleet)
    except ValueError as exc:
        log.error("not starting: %s", exc)
        return 2
    serve.start(http_options={"host": settings.host, "port": settings.port})
    log.info("starting %d replica(s) of %s (compiling without a cache takes minutes)", args.replicas, settings.model)
    serve.run(app, name=APP, route_prefix="/")
    stopping: list[int] = []  # a flag, not an Event: Event.set in a signal handler can deadlock its wait
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: stopping.append(signum))
    # once a signal shuts it down in order: a supervisor may stop it as soon as it reads this line
    log.info("listening on http://%s:%d (%s)", settings.host, settings.port,
             f"autoscaling {fleet.autoscaling(settings)}" if args.min_replicas or args.max_replicas
             else f"{args.replicas} replica(s)")
    while not stopping:
        time.sleep(0.2)
    log.info("shutting down: replicas finish their streams (up to %.0f s)", settings.drain_timeout_s)
    serve.delete(APP)
    serve.shutdown()
    ray.shutdown()
    return 0
