"""The Makefile's install stamps: a target installs only what no earlier install already holds."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")


@pytest.fixture
def tree(tmp_path):
    """A copy of the Makefile and what its stamps depend on, with a stand-in .venv (its python never runs:
    the tests ask make what it would do, `make -n`)."""
    for name in ("Makefile", "pyproject.toml", "requirements-reference.txt"):
        shutil.copy(ROOT / name, tmp_path / name)
        os.utime(tmp_path / name, (1_000_000, 1_000_000))
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").touch()
    return tmp_path


def dry_run(tree: Path, target: str, *stamps: str) -> str:
    for stamp in stamps:
        (tree / ".venv" / f".{stamp}").touch()
    return subprocess.run(["make", "-n", target], cwd=tree, capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("target", ["synth", "serve", "study", "explore"])
def test_after_make_test_no_target_installs_again(tree, target):
    assert "pip install" not in dry_run(tree, target, "dev")


def test_a_fresh_tree_installs_only_what_the_target_needs(tree):
    assert 'pip install --quiet --no-compile -e .\n' in dry_run(tree, "synth")
    assert '-e ".[study]"' in dry_run(tree, "study")


def test_a_changed_pyproject_reinstalls_the_install_that_covers_the_target(tree):
    (tree / ".venv" / ".dev").touch()
    os.utime(tree / ".venv" / ".dev", (2_000_000, 2_000_000))
    (tree / "pyproject.toml").touch()  # newer than the stamp
    assert '-e ".[dev]"' in dry_run(tree, "synth")
