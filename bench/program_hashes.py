"""Whether two source trees build the same engine programs: each tree's runner lowers every program of one engine
configuration, and the StableHLO texts are hashed without their source locations (which name files and lines, not
what runs). Equal hashes mean a change cannot move the device's timings; only the host's work around the calls can
(bench/host_loop.py measures that). Runs on any backend; on a CPU the "auto" kernels are the jnp paths. Writes JSON.

    git worktree add --detach /tmp/base REV
    python bench/program_hashes.py --trees /tmp/base,. --out runs/program-hashes.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

_LOCATION = re.compile(r"loc\(.*?\)|#loc\d* = .*\n")


def hashes(tree: str, model: str, slots: int, context: int) -> dict[str, str]:
    """Program key -> hash of its lowered text, built by the package in `tree` (run in a process of its own)."""
    sys.path.insert(0, str(Path(tree).resolve()))
    from qtts_jax.engine import EngineConfig
    from qtts_jax.engine.runner import Runner, stages
    from qtts_jax.model import load_model

    config = EngineConfig(slots=slots, context=context, prompt_buckets=(32, 64), max_trailing=64, frames_per_step=2)
    runner = Runner(load_model(model), config)
    return {":".join(map(str, key)): hashlib.sha256(_LOCATION.sub("", runner.lower(*key).as_text()).encode())
            .hexdigest()[:16] for stage in stages(config) for key in stage}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", required=True, help="two source trees, comma-separated: A,B")
    p.add_argument("--model", default="tiny-random")
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--out", required=True)
    p.add_argument("--one", help=argparse.SUPPRESS)  # the child process: hash one tree, print JSON
    args = p.parse_args()
    if args.one:
        print(json.dumps(hashes(args.one, args.model, args.slots, args.context)))
        return
    found = {}
    for tree in args.trees.split(","):
        cmd = [sys.executable, __file__, "--trees", args.trees, "--model", args.model, "--slots", str(args.slots),
               "--context", str(args.context), "--out", args.out, "--one", tree]
        found[tree] = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    a, b = found.values()
    commits = [subprocess.run(["git", "-C", tree, "describe", "--always", "--dirty"], capture_output=True,
                              text=True).stdout.strip() for tree in found]
    result = {"model": args.model, "slots": args.slots, "context": args.context, "trees": list(found),
              "commits": commits,
              "programs": len(a), "differ": sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k)),
              "hashes": found}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("programs", "differ")}))


if __name__ == "__main__":
    main()
