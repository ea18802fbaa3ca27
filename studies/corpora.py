"""Prompt sets for studies: one prompt per line in studies/corpora/<name>.txt, so they diff and review well."""

from __future__ import annotations

from pathlib import Path

CORPORA = Path(__file__).parent / "corpora"


def load_corpus(name: str = "voice_agent") -> list[str]:
    """The prompts of a named corpus (or a path to a .txt file), blank lines skipped."""
    path = Path(name) if name.endswith(".txt") else CORPORA / f"{name}.txt"
    if not path.is_file():
        known = sorted(p.stem for p in CORPORA.glob("*.txt"))
        raise ValueError(f"corpus {name!r} not found; known corpora: {known} (or pass a path to a .txt file)")
    prompts = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"corpus {path} has no prompts")
    return prompts
