"""The tuned XLA flags join XLA_FLAGS without overriding what the user set there."""

from __future__ import annotations

import os

from qtts_jax import xla_flags


def test_tuned_flags_are_added_once_and_a_users_setting_wins(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    xla_flags.apply()
    xla_flags.apply()
    assert os.environ["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/d", *xla_flags.TUNED]
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    xla_flags.apply()
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=true"


def test_a_training_process_claims_most_of_the_device_unless_the_user_chose(monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    xla_flags.claim_device_memory()
    assert float(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]) > 0.75  # JAX's own default
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".5")
    xla_flags.claim_device_memory()
    assert os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] == ".5"
