"""The Serve application: the engine deployment (one engine per replica: `num_gpus=1` on GPUs, CPU replicas for
tests) behind the front, its stream-aware router, and autoscaling on live streams.

Each replica's ongoing requests are its open streams (and WebSocket sessions), so Ray Serve's autoscaler, aiming at
`target_ongoing_requests` per replica, scales on live streams: the target is the replica's measured safe capacity
(the capacity study's) less warm headroom, `safe / (1 + headroom)`, as `qtts-jax study fleet` sizes a fleet with 40%
headroom. A replica being removed takes no new work and is stopped only once its streams have ended (Ray Serve's
graceful shutdown, waiting up to the server's drain timeout), so a scale-down cuts no admitted stream.
"""

from __future__ import annotations

import dataclasses
import json
import os

from qtts_jax import xla_flags
from serving.http_api import auth
from serving.settings import Settings

# Ray Serve's replicas and handles report ongoing requests every 10 s by default: too slow to follow live streams.
# Its throughput-optimised mode (gRPC between deployments, user code and router on the replica's own event loop,
# buffered request logs) takes a third off the fleet's first-audio overhead over `qtts-jax serve`
# (bench/fleet_scaling.py on 2 CPU cores: +24 ms at the median without it, +16 to +17 ms in three runs with it).
# HAProxy as the HTTP ingress, forwarding to the front's own direct-ingress port instead of Serve's Python proxy
# relaying it through a handle, takes about 6 ms more off (+14.3 to +15.7 ms -> +7.5 to +8.8 ms; Ray bundles
# the binary).
RAY_ENV = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
           "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
           "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
           "RAY_SERVE_ENABLE_HA_PROXY": "1"}
ENGINE = "Engine"  # the engine deployment's name (the front's router registry is keyed by it)
FRONT = "Front"


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    replicas: int = 1  # fixed count, or the initial one when autoscaling
    min_replicas: int | None = None  # either bound set: autoscale between them
    max_replicas: int | None = None
    safe_capacity: float | None = None  # streams one replica carries within the SLOs (default: its slots)
    headroom: float = 0.4  # warm capacity kept beyond the live streams
    gpus: float = 0.0  # per replica: 1 on a GPU cluster
    cpus: float = 1.0
    upscale_delay_s: float = 3.0
    downscale_delay_s: float = 60.0
    look_back_period_s: float = 10.0
    stats_period_s: float = 0.5  # how often Ray Serve pulls each replica's stats for the router

    def autoscaling(self, settings: Settings) -> dict | None:
        """Ray Serve's autoscaling_config, or None for a fixed count."""
        if self.min_replicas is None and self.max_replicas is None:
            return None
        lo = 1 if self.min_replicas is None else self.min_replicas
        hi = max(lo, self.replicas) if self.max_replicas is None else self.max_replicas
        if not 0 <= lo <= hi or hi < 1:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas, max >= 1 (got {lo}, {hi})")
        safe = self.safe_capacity
        if safe is None:
            if not isinstance(settings.slots, int):
                raise ValueError("autoscaling with --slots auto needs --safe-capacity (a capacity study's number)")
            safe = settings.slots
        if safe <= 0 or self.headroom < 0:
            raise ValueError(f"need safe capacity > 0 and headroom >= 0 (got {safe}, {self.headroom})")
        return {"min_replicas": lo, "max_replicas": hi, "initial_replicas": min(max(self.replicas, lo), hi),
                "target_ongoing_requests": safe / (1 + self.headroom), "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s, "look_back_period_s": self.look_back_period_s}

    def actor_options(self) -> dict:
        """Ray's options for an engine replica. A CPU replica of one CPU runs XLA on one thread: Ray reserves it
        one core, and XLA's default pool of every core's threads would contend with the other replicas."""
        options = {"num_gpus": self.gpus, "num_cpus": self.cpus}
        if self.gpus == 0 and self.cpus <= 1:
            flags = xla_flags.merged(os.environ.get("XLA_FLAGS", ""), xla_flags.ONE_CORE)
            options["runtime_env"] = {"env_vars": {"XLA_FLAGS": flags}}
        return options


def safe_capacity_from(summary_path: str) -> tuple[float, str]:
    """The `safe_capacity` a capacity study's summary.json gives the autoscaler, and why. Ray Serve scales on ongoing
    requests only, which here are a replica's open streams: the study's chosen signal's threshold when it chose open
    or generating streams (`scale_signal.slo.fleet_safe_capacity`), else a closed-loop study's safe capacity (its
    clients are streams offered; an open loop's requests per second are not). ValueError when neither is there."""
    with open(summary_path, encoding="utf-8") as f:
        summary = json.load(f)
    choice = (summary.get("scale_signal") or {}).get("slo") or {}
    if choice.get("fleet_safe_capacity"):
        return float(choice["fleet_safe_capacity"]), (f"the study's scale signal {choice['signal']}, "
                                                      f"threshold {choice['threshold']:g}")
    why = (f"the study chose {choice['signal']} (threshold {choice['threshold']:g}), which Ray Serve cannot scale on"
           if choice.get("status") == "chosen" else f"the study's scale signal is undecided ({choice.get('reason')})")
    if summary.get("mode") == "closed" and summary.get("safe_capacity", 0) > 0:
        return float(summary["safe_capacity"]), f"its safe capacity in clients: {why}"
    raise ValueError(f"{summary_path}: no number for the autoscaler: {why}, and no closed-loop safe capacity")


def build(settings: Settings, fleet: FleetConfig = FleetConfig(), engine_factory=None):
    """The bound Serve application (`serve.run(build(...))`). `engine_factory(settings)`, where given, builds each
    replica's engine (an importable function: bench/fleet_scaling.py's replicas over a simulated device)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from fleet.front import Front
    from fleet.replica import Replica
    from fleet.router import StreamRouter

    auth.keyring(settings)  # keys missing where the fleet listens, or a malformed keys file: refused before Ray
    slots = settings.slots if isinstance(settings.slots, int) else 256
    scaling = fleet.autoscaling(settings)
    engine = serve.deployment(
        Replica, name=ENGINE,
        # Ray's access log line per request and hop: the server logs each request itself
        ray_actor_options=fleet.actor_options(), logging_config={"enable_access_log": False},
        # the engine's own admission decides; Ray's cap only bounds what a replica is ever handed
        max_ongoing_requests=4 * slots + 64,
        **({"autoscaling_config": scaling} if scaling else {"num_replicas": fleet.replicas}),
        graceful_shutdown_timeout_s=settings.drain_timeout_s, graceful_shutdown_wait_loop_s=0.25,
        request_router_config=RequestRouterConfig(request_router_class=StreamRouter,
                                                  request_routing_stats_period_s=fleet.stats_period_s,
                                                  request_routing_stats_timeout_s=5.0),
    )
    front = serve.deployment(serve.ingress()(Front), name=FRONT, num_replicas=1, max_ongoing_requests=100_000,
                             ray_actor_options={"num_cpus": 0}, logging_config={"enable_access_log": False})
    return front.bind(engine.bind(settings, engine_factory), settings, ENGINE)


def from_env(args: dict | None = None):
    """The application from QTTS_* (each replica's server settings) and FLEET_* variables: a RayService's
    `import_path: fleet.app:from_env` (deploy/rayservice.yaml)."""

    def env(name: str, kind=float, default=None):
        value = os.environ.get(f"FLEET_{name}", "")
        return kind(value) if value else default

    fleet = FleetConfig(replicas=env("REPLICAS", int, 1), min_replicas=env("MIN_REPLICAS", int),
                        max_replicas=env("MAX_REPLICAS", int), safe_capacity=env("SAFE_CAPACITY"),
                        headroom=env("HEADROOM", float, 0.4), gpus=env("GPUS_PER_REPLICA", float, 0.0))
    # the cluster's ingress listens on every interface: keys (QTTS_API_KEY or a keys file, from a Kubernetes secret)
    # or QTTS_API_KEY=none are required unless QTTS_HOST says otherwise
    return build(Settings.from_env(**({} if os.environ.get("QTTS_HOST") else {"host": "0.0.0.0"})), fleet)
