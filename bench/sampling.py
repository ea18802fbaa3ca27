"""GPU benchmark: Pallas sampling kernel vs the jnp reference, per batch size and vocabulary.

V=3072 times the talker path (`sample_talker*`, penalty and masks included), V=2048 the code
predictor's (`sample_plain*`). Each timed call applies the sampler `--inner` times inside one jit
(a loop whose noise depends on the step, so nothing is hoisted), as the engine calls it inside its
step: the per-call time then excludes host dispatch. Median of `--runs` after `--warmup`.
Every row also counts the batch rows where the kernel's token differs from the reference's.

Settings (`--mixes`): `default` = every row sampling with Qwen3-TTS's defaults (T 0.9, top-k 50,
top-p 1.0: the kernel skips top-p); `full` = top-k 50 and top-p 0.9 on every row (both searches);
`mixed` = the tests' random per-row mix (greedy rows, top-k 0/1/…, top-p down to 0).

A failure (e.g. the kernel not lowering on this GPU/JAX) is recorded as text in its row instead of
stopping the run, so one GPU run always yields a JSON result.

    python bench/sampling.py --out runs/bench-sampling.json            # on the GPU
    python bench/sampling.py --interpret --quick --out /tmp/s.json     # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from qtts_jax.kernels import sampling as ks  # noqa: E402
from qtts_jax.talker.sampling import SamplingParams  # noqa: E402

EOS = 2150
BATCHES = (1, 8, 32, 64, 128, 256, 512)
QUICK_BATCHES = (1, 8)
VOCABS = (3072, 2048)


def make_params(rng: np.random.Generator, batch: int, vocab: int, mix: str) -> SamplingParams:
    if mix == "default":
        return SamplingParams.make(False, 0.9, 50, 1.0)
    if mix == "full":
        return SamplingParams.make(False, 0.9, 50, 0.9)
    if mix == "mixed":
        return SamplingParams(
            greedy=jnp.asarray(rng.random(batch) < 0.25),
            temperature=jnp.asarray(rng.choice([0.3, 0.7, 0.9, 1.0, 1.7], batch), jnp.float32),
            top_k=jnp.asarray(rng.choice([0, 1, 2, 10, 50, vocab, vocab + 100], batch), jnp.int32),
            top_p=jnp.asarray(rng.choice([1.0, 0.95, 0.8, 0.5, 0.2, 0.0], batch), jnp.float32),
        )
    raise ValueError(f"unknown mix {mix!r}")


def make_inputs(batch: int, vocab: int, mix: str, seed: int = 0) -> tuple:
    """Arguments of the sampler for one (B, V, mix): talker arguments at 3072, plain ones otherwise."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(*(jnp.broadcast_to(f, (batch,)) for f in make_params(rng, batch, vocab, mix)))
    logits = jnp.asarray(rng.standard_normal((batch, vocab)).astype(np.float32) * 3)
    gumbel = jax.random.gumbel(jax.random.PRNGKey(seed), (batch, vocab), jnp.float32)
    if vocab != 3072:
        return logits, params, gumbel
    seen = jnp.asarray(rng.random((batch, vocab)) < 0.03)
    penalty = jnp.full((batch,), 1.05, jnp.float32)
    num_generated = jnp.full((batch,), 5, jnp.int32)
    return logits, seen, penalty, num_generated, params, gumbel


def sampler(vocab: int, kernel: bool, interpret: bool):
    """The sampler as f(*make_inputs(...)) -> tokens."""
    if vocab == 3072:
        fn = ks.sample_talker if kernel else ks.sample_talker_ref
        return lambda x, s, pen, n, p, g: fn(x, s, pen, n, EOS, p, g, interpret=interpret)
    fn = ks.sample_plain if kernel else ks.sample_plain_ref
    return lambda x, p, g: fn(x, p, g, interpret=interpret)


def looped(fn, inner: int):
    """One jit applying `fn` `inner` times; the noise moves with the step so no call is hoisted."""

    def run(*args):
        *rest, gumbel = args

        def body(i, tokens):
            return fn(*rest, gumbel + i.astype(jnp.float32) * 1e-30)

        return lax.fori_loop(0, inner, body, jnp.zeros(gumbel.shape[0], jnp.int32))

    return jax.jit(run)


def time_us(fn, args, warmup: int, runs: int, inner: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) / inner * 1e6


def error_text(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    return text if len(text) <= 4000 else text[:2000] + "\n…\n" + text[-2000:]


def bench_row(batch: int, vocab: int, mix: str, args) -> dict:
    row = dict(B=batch, V=vocab, mix=mix, kernel_us=None, reference_us=None, ratio=None, mismatches=None)
    inputs = make_inputs(batch, vocab, mix)
    tokens = {}
    for name, kernel in (("kernel", True), ("reference", False)):
        try:
            fn = looped(sampler(vocab, kernel, args.interpret), args.inner)
            row[f"{name}_us"] = round(time_us(fn, inputs, args.warmup, args.runs, args.inner), 2)
            tokens[name] = np.asarray(jax.jit(sampler(vocab, kernel, args.interpret))(*inputs))
        except Exception as exc:  # noqa: BLE001 - recorded so the run still yields a result
            row[f"{name}_error"] = error_text(exc)
    if row["kernel_us"] and row["reference_us"]:
        row["ratio"] = round(row["reference_us"] / row["kernel_us"], 3)
    if len(tokens) == 2:
        row["mismatches"] = int((tokens["kernel"] != tokens["reference"]).sum())
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/bench-sampling.json"))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated batch sizes")
    ap.add_argument("--mixes", default="default,full", help="comma-separated: default, full, mixed")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--inner", type=int, default=20, help="sampler calls per timed jit call")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (CPU)")
    ap.add_argument("--quick", action="store_true", help="B in (1, 8), 3 runs, 1 warmup, inner 2")
    args = ap.parse_args(argv)
    batches = QUICK_BATCHES if args.quick else tuple(int(b) for b in args.batches.split(","))
    if args.quick:
        args.runs, args.warmup, args.inner = 3, 1, 2

    device = jax.devices()[0]
    result = dict(
        device=f"{device.platform}:{device.device_kind}",
        jax_version=jax.__version__,
        interpret=args.interpret,
        inner=args.inner,
        runs=args.runs,
        rows=[],
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for mix in args.mixes.split(","):
        for vocab in VOCABS:
            for batch in batches:
                row = bench_row(batch, vocab, mix, args)
                result["rows"].append(row)
                args.out.write_text(json.dumps(result, indent=1))  # partial results survive a kill
                errors = "  ERROR" if any(k.endswith("_error") for k in row) else ""
                print(f"{mix:8s} V={vocab} B={batch:4d}  kernel {row['kernel_us']} us  "
                      f"reference {row['reference_us']} us  ratio {row['ratio']}  "
                      f"mismatches {row['mismatches']}{errors}", flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
