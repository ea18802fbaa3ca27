"""Test session setup: the reference's torchaudio stand-in on sys.path, JAX in float32 on CPU, one XLA
compilation cache for the session, and the models, reference builds and engines that several files use.

Helpers that are not fixtures (engine drivers, audio checks) live in `support.py`; no test module imports
another."""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# One thread per process for the reference (torch, OpenMP), numpy's BLAS and XLA's CPU kernels: the tiny models'
# ops are too small to gain from threads, and idle threads that spin cost the other test processes (xdist workers,
# servers) their CPU; measured: half the CPU time of the parity tests on 2 cores. Set before anything loads them.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
if "xla_cpu_multi_thread_eigen" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
# Compiling is most of a test run's time (the tiny models run in microseconds): the test processes and the servers
# they start compile without LLVM's optimisation passes and with XLA CPU's older elemental emitters instead of its
# MLIR fusion emitters, which cuts each compile to about 40% (tiny-random's step, first-frame and codec programs:
# 11.0 s -> 4.5 s; a 2-slot server ready in 13 s instead of 32 s; `make test` 14.4 -> 10.2 min on 2 cores). The
# programs compute the same arithmetic, parity is asserted at the same tolerances, and they still run faster than
# real time (a 2-slot server's step: 35 ms a frame instead of 18). Not the fleet's replicas: four processes on two
# cores at half speed run slower than real time, and their admission rightly refuses (`serving_xla_flags`).
_SERVING_XLA_FLAGS = os.environ["XLA_FLAGS"]
os.environ["XLA_FLAGS"] = " ".join(
    [_SERVING_XLA_FLAGS, "--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false",
     "--xla_llvm_disable_expensive_passes=true"])
sys.path.insert(0, str(Path(__file__).parent / "refstub"))

# One persistent compilation cache per test session, empty when it starts: an engine or model loads a program
# that another compiled earlier in the run (same shapes: either tiny model, any engine of the same
# configuration) instead of compiling it again; xdist workers share it. Every run still compiles each program it
# runs at least once. Set QTTS_TEST_COMPILE_CACHE to a directory to keep the cache between runs (it is then not removed).
if not os.environ.get("QTTS_TEST_COMPILE_CACHE"):
    os.environ["QTTS_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="qtts-test-xla-")
    atexit.register(shutil.rmtree, os.environ["QTTS_TEST_COMPILE_CACHE"], ignore_errors=True)

import jax  # noqa: E402

# Parity is checked in fp32; XLA's default matmul precision on CPU is already full fp32, but say so.
jax.config.update("jax_default_matmul_precision", "highest")

from qtts_jax.engine import compile_cache  # noqa: E402

compile_cache.enable(os.environ["QTTS_TEST_COMPILE_CACHE"])
# The `qtts-jax serve` subprocesses share the session's cache too (their programs, at the default matmul precision,
# have keys of their own): a test run never reads or fills the user's cache, so a run here compiles what a fresh CI
# machine compiles.
os.environ.setdefault("QTTS_COMPILE_CACHE", os.environ["QTTS_TEST_COMPILE_CACHE"])

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def serving_xla_flags() -> str:
    """XLA_FLAGS without the suite's fast-compile flags: for servers whose tests need them as fast as the product."""
    return _SERVING_XLA_FLAGS


@pytest.fixture(scope="session")
def reference_checkpoint(tmp_path_factory):
    """Factory: (kind, size, shape) -> (reference torch model, checkpoint dir), built once per session."""
    built = {}

    def get(kind: str = "custom_voice", size: str = "1b7", shape: str = "narrow_predictor_mqa"):
        key = (kind, size, shape)
        if key not in built:
            from ref_model import build_reference_model, config_dict, write_checkpoint

            model = build_reference_model(config_dict(kind, size, shape), seed=len(built))
            directory = tmp_path_factory.mktemp(f"ckpt-{kind}-{size}-{shape}")
            built[key] = (model, write_checkpoint(directory, model, seed=len(built)))
        return built[key]

    return get


@pytest.fixture(scope="session")
def checkpoint_model(reference_checkpoint):
    """Factory: (kind, size, shape, dtype) -> our `Model` loaded from that reference checkpoint, once per session
    (its compiled generate programs come with it). Tests must not change it."""
    built = {}

    def get(kind: str = "custom_voice", size: str = "1b7", shape: str = "narrow_predictor_mqa", dtype=None):
        import jax.numpy as jnp

        from qtts_jax.model import load_model

        dtype = jnp.dtype(dtype or jnp.float32)
        key = (kind, size, shape, dtype)
        if key not in built:
            _, directory = reference_checkpoint(kind, size, shape)
            built[key] = load_model(directory, dtype=dtype)
        return built[key]

    return get


@pytest.fixture(scope="session")
def reference_wrapper(reference_checkpoint):
    """Factory: kind -> (the reference's `Qwen3TTSModel` loaded from our test checkpoint directory, offline; dir)."""
    built = {}

    def get(kind: str):
        if kind not in built:
            from qwen_tts import Qwen3TTSModel

            _, directory = reference_checkpoint(kind)
            built[kind] = (Qwen3TTSModel.from_pretrained(str(directory)), directory)
        return built[kind]

    return get


@pytest.fixture(scope="session")
def reference_codec():
    """The reference 12 Hz tokenizer model (tiny config, randomised, seed 0). Tests must not change it."""
    from ref_codec import build_reference_codec

    return build_reference_codec(seed=0)


@pytest.fixture(scope="session")
def codec_checkpoint(reference_codec, tmp_path_factory):
    """`reference_codec` written as a checkpoint directory (speech_tokenizer/ layout). Tests must not change it."""
    from ref_codec import write_codec_checkpoint

    return write_codec_checkpoint(tmp_path_factory.mktemp("model") / "speech_tokenizer", reference_codec)


@pytest.fixture(scope="session")
def keys_file(tmp_path_factory) -> str:
    """A keys file (`--api-key @FILE`) with support.py's keys: admin, speak, speak capped at one stream, metrics."""
    from support import ADMIN_KEY, CAPPED_KEY, SCRAPE_KEY, SPEAK_KEY

    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(f"# the tests' keys\n{ADMIN_KEY} admin\n{SPEAK_KEY} speak\n\n{CAPPED_KEY} speak 1\n"
                    f"{SCRAPE_KEY} metrics\n")
    return str(path)


@pytest.fixture(scope="session")
def tiny_model():
    """`tiny-random` (CustomVoice), loaded once per session. Tests must not change it."""
    from qtts_jax.model import load_model

    return load_model("tiny-random")


@pytest.fixture(scope="session")
def tiny_base_model():
    """`tiny-random-base`, loaded once per session. Tests must not change it."""
    from qtts_jax.model import load_model

    return load_model("tiny-random-base")



# The slowest files first (30 s to 150 s each on 2 cores, slowest first), the rest in their own order: with
# `make test`'s `-n 2 --dist loadfile`, the two workers then finish close together instead of one waiting on a
# slow file dealt last, and the first file of each engine configuration (test_engine: STREAMING, test_server:
# SMALL) compiles it before the files that load it from the compilation cache. Only the order of files changes.
SLOW_FILES_FIRST = ("test_generate_parity.py", "test_engine.py", "test_studies_server.py", "test_server.py",
                    "test_server_voices.py", "test_end_to_end.py", "test_hardening.py", "test_clients.py",
                    "test_server_text.py", "test_engine_clone.py", "test_finetune_train.py", "test_logits_parity.py",
                    "test_voice_clone.py", "test_startup.py", "test_warmup.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order
