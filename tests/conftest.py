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

import pytest  # noqa: E402


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
