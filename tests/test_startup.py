"""Start-up: slots sized to free memory (auto, or refused when too many), exit on a failed warm-up, and the
persistent compilation cache filled by one start and read by the next."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import subprocess
import sys
import time

import jax
import pytest

from qtts_jax.engine import compile_cache, sizing
from qtts_jax.codec import streaming as codec_streaming
from qtts_jax.engine import EngineConfig, init_state
from serving.app import ENGINE, SETTINGS, Settings, create_app, run, serve_alone
from studies.server import server_command
from support import ChildOutput

CONFIG = EngineConfig(slots=1, context=128, prompt_buckets=(32, 64), max_trailing=64)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model


@dataclasses.dataclass
class Gpu:
    """A device as jax reports an accelerator: allocator statistics, platform and id."""

    bytes_limit: int
    bytes_in_use: int
    platform: str = "gpu"
    id: int = 0

    def memory_stats(self):
        return {"bytes_limit": self.bytes_limit, "bytes_in_use": self.bytes_in_use}


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_slot_bytes_are_one_more_slot_of_engine_and_codec_state_plus_workspace(model):
    plan = sizing.plan(model, CONFIG, Gpu(bytes_limit=10 * 2**30, bytes_in_use=2**30))
    engine_slot = (nbytes(init_state(model.cfg, model.dtype, dataclasses.replace(CONFIG, slots=3)))
                   - nbytes(init_state(model.cfg, model.dtype, dataclasses.replace(CONFIG, slots=2))))
    assert plan.state_bytes == engine_slot + nbytes(codec_streaming.init_state(model.codec_cfg, 1))
    assert plan.workspace_bytes > 0 and plan.slot_bytes == plan.state_bytes + plan.workspace_bytes
    assert plan.free_bytes == 9 * 2**30 and plan.fixed_bytes == int(sizing.RESERVE_FRACTION * 9 * 2**30)
    assert plan.fit == (plan.free_bytes - plan.fixed_bytes) // plan.slot_bytes
    longer = sizing.plan(model, dataclasses.replace(CONFIG, context=256), Gpu(10 * 2**30, 2**30))
    assert longer.state_bytes > plan.state_bytes  # the KV cache grows with the context


def test_auto_takes_every_slot_that_fits_and_a_larger_count_is_refused_with_what_fits(model):
    gpu = Gpu(bytes_limit=2**30, bytes_in_use=2**28)
    slots, plan = sizing.resolve_slots(model, CONFIG, "auto", gpu)
    assert slots == plan.fit > sizing.CPU_SLOTS
    assert sizing.resolve_slots(model, CONFIG, slots, gpu)[0] == slots
    with pytest.raises(sizing.SlotsDoNotFit, match=rf"{slots + 1} slots do not fit: {slots} slots fit .* per slot"):
        sizing.resolve_slots(model, CONFIG, slots + 1, gpu)
    with pytest.raises(sizing.SlotsDoNotFit, match="not even one slot fits"):
        sizing.resolve_slots(model, CONFIG, "auto", Gpu(bytes_limit=2**20, bytes_in_use=0))


def test_auto_on_a_cpu_is_a_few_slots_and_host_ram_bounds_a_count(model):
    slots, plan = sizing.resolve_slots(model, CONFIG, "auto")
    assert jax.devices()[0].platform == "cpu" and plan.source == "of available host RAM"
    assert slots == min(sizing.CPU_SLOTS, plan.fit) == sizing.CPU_SLOTS
    # twice what fits: available RAM is read anew and moves between the calls (other processes), by far more
    # than one tiny slot's bytes, but not by as much again
    with pytest.raises(sizing.SlotsDoNotFit):
        sizing.resolve_slots(model, CONFIG, 2 * plan.fit)


def test_settings_take_slots_auto_and_the_compile_cache_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("QTTS_SLOTS", "auto")
    monkeypatch.setenv("QTTS_COMPILE_CACHE", "off")
    assert (Settings.from_env().slots, Settings.from_env().compile_cache) == ("auto", "off")
    monkeypatch.setenv("QTTS_SLOTS", "16")
    assert Settings.from_env().slots == 16 and Settings().compile_cache == "default"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache.default_dir() == tmp_path / "qtts-jax" / "xla"


def test_the_weights_default_to_bfloat16_on_a_gpu_and_float32_elsewhere(monkeypatch):
    """`serve --model DIR` gets the fast dtype capacity is measured at on a GPU, the reference's on a CPU (parity);
    a dtype named by flag or variable is kept anywhere."""
    from qtts_jax.model import weights_dtype  # what the core process loads `Settings.dtype` as

    assert Settings().dtype == "auto" and weights_dtype(Settings().dtype) == "float32"  # this machine: a CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert weights_dtype(Settings().dtype) == "bfloat16"
    monkeypatch.setenv("QTTS_DTYPE", "float32")
    assert weights_dtype(Settings.from_env().dtype) == "float32"


def test_create_app_sizes_auto_slots_and_refuses_a_count_that_does_not_fit(model):
    app = create_app(Settings(slots="auto", context=128), model=model)
    assert app[ENGINE].config.slots == app[SETTINGS].slots == sizing.CPU_SLOTS
    with pytest.raises(sizing.SlotsDoNotFit, match="slots do not fit"):
        create_app(Settings(slots=10**9, context=128), model=model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_and_stop(*args: str, warmup: bool = False, stop_on: str = "ready after") -> tuple[int, str, float, float]:
    """Runs `qtts-jax serve` until it logs `stop_on` (by default that it is ready: /ready is 200 from then on, as
    nothing compiles in the background on a CPU), then SIGTERM; returns (exit code, log, seconds to the signal,
    seconds from the signal to the exit). Without `warmup` (the server's `--no-warmup`), only the calibration
    request's programs compile, which keeps the starts short on a CPU."""
    proc = subprocess.Popen(server_command("--model", "tiny-random", "--port", str(free_port()), *args,
                                           engine={"frames_per_step": 1}, warmup=warmup),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu", "QTTS_DRAIN_TIMEOUT_S": "1"})
    output = ChildOutput(proc)
    t0 = time.monotonic()
    try:
        output.wait_for(stop_on, 120)  # or it exited first
        elapsed = time.monotonic() - t0
        proc.terminate()
        code = proc.wait(timeout=60)
        exit_s = time.monotonic() - t0 - elapsed
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, output.text(), elapsed, exit_s


def test_run_refuses_slots_that_do_not_fit_before_listening(caplog):
    caplog.set_level(logging.INFO)
    settings = Settings(slots=10**9, port=free_port(), compile_cache="off")
    assert run(settings) == 2
    assert re.search(r"not starting: 1000000000 slots do not fit: \d+ slots fit .* MiB per slot", caplog.text)
    assert "listening" not in caplog.text


def test_a_serving_process_shortens_the_switch_interval():
    """The engine thread, back from a device call, waits at most 0.1 ms for the GIL the event loop holds."""
    from aiohttp import web

    app = web.Application()
    app[SETTINGS], app[ENGINE] = Settings(), type("Engine", (), {})()
    before = sys.getswitchinterval()
    try:
        serve_alone(app)
        assert sys.getswitchinterval() == pytest.approx(1e-4)
    finally:
        sys.setswitchinterval(before)


def test_run_refuses_to_listen_beyond_loopback_without_a_key_and_names_the_fix(caplog, tmp_path):
    """Before anything is loaded: no key on 0.0.0.0 (unless `--api-key none`), or a keys file with a bad line,
    exits 2 with what to do, and the log never shows a key."""
    caplog.set_level(logging.INFO)
    assert run(Settings(host="0.0.0.0", compile_cache="off")) == 2
    assert ("not starting: --host 0.0.0.0 is reachable beyond this machine and no API key is set: give one with "
            "--api-key KEY (or QTTS_API_KEY), several with --api-key @FILE, or --api-key none") in caplog.text
    keys = tmp_path / "keys.txt"
    for text, why in (("key-on-line-one-xx admin\nkey-on-line-two-xx admin 0\n", "line 2: MAX_STREAMS must be a"),
                      ("# a comment\n\nkey-on-line-three-x owner\n", "line 3: role 'owner' is not one of speak,"),
                      ("key-on-line-one-xx\n", "line 1: expected KEY ROLE [MAX_STREAMS], got 1 fields"),
                      ("short speak\n", "line 1: a key must be at least 16 characters"),
                      ("key-on-line-one-xx speak\nkey-on-line-one-xx admin\n", "line 1: this key is given twice")):
        keys.write_text(text)
        assert run(Settings(host="0.0.0.0", api_key=f"@{keys}", compile_cache="off")) == 2
        assert f"not starting: {keys} {why}" in caplog.text
    assert run(Settings(api_key=f"@{tmp_path / 'missing'}", compile_cache="off")) == 2
    assert "cannot be read (FileNotFoundError)" in caplog.text
    assert "key-on-line" not in caplog.text and "listening" not in caplog.text


def test_run_exits_1_with_the_reason_when_warm_up_fails(caplog):
    caplog.set_level(logging.INFO)
    # a 24-row context leaves a 12-token prompt bucket: the calibration request cannot be prefilled
    settings = Settings(slots=1, context=24, port=free_port(), warmup=False, compile_cache="off")
    assert run(settings) == 1
    assert "listening" in caplog.text
    assert re.search(r"warm-up failed, exiting: .*prompt of \d+ tokens exceeds the largest bucket", caplog.text)


def test_a_second_start_loads_every_program_from_the_compile_cache(tmp_path):
    """The engine's programs are kept whole and load untraced on the second start; what else XLA compiled comes
    from its own cache."""
    cache = tmp_path / "xla"
    args = ("--slots", "1", "--context", "128", "--compile-cache", str(cache))
    code1, log1, ready1, _ = start_and_stop(*args)
    xla_entries = len([p for p in cache.iterdir() if p.name != "engine"])
    (stored,) = [len(list(d.iterdir())) for d in (cache / "engine").iterdir()]  # one store: one engine's programs
    code2, log2, ready2, _ = start_and_stop(*args)
    assert code1 == code2 == 0
    ((made, total),) = re.findall(r"ready after .*; 0 engine programs loaded whole and (\d+) made; (\d+) XLA "
                                  rf"programs: 0 loaded from the compilation cache {cache}, \2 compiled", log1)
    assert stored == int(made) > 0 and xla_entries == int(total) > 0  # one file per program
    (rest,) = re.findall(rf"ready after .*; {made} engine programs loaded whole and 0 made; (\d+) XLA programs: "
                            rf"\1 loaded from the compilation cache {cache}, 0 compiled", log2)
    assert int(rest) < int(total)  # the engine's programs were not even traced
    assert ready2 < ready1


def test_a_signal_during_the_warm_up_stops_the_server_at_once_and_exits_0():
    """XLA's compiles cannot be stopped: a server told to stop while it compiles exits without waiting for them (it
    once waited out the whole warm-up, and on a GPU crashed at exit under its background compiles)."""
    code, text, _, exit_s = start_and_stop("--slots", "64", "--compile-cache", "off", warmup=True,
                                           stop_on="listening on")  # the warm-up started before it listens
    assert "ready after" not in text  # the signal came during the warm-up
    assert code == 0 and exit_s < 10, (code, exit_s, text[-2000:])
    assert "exiting before the warm-up's compiles finish\n" in text  # no compilation cache to speak of
