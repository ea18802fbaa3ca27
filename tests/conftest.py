"""Test session setup: the reference's torchaudio stand-in on sys.path, JAX in float32 on CPU."""

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent / "refstub"))

import jax  # noqa: E402

# Parity is checked in fp32; XLA's default matmul precision on CPU is already full fp32, but say so.
jax.config.update("jax_default_matmul_precision", "highest")
