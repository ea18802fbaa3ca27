"""Runs a study notebook (jupytext percent .py in notebooks/) with papermill and renders its HTML report.

The .py file is the reviewed source; the executed .ipynb is kept next to the report as provenance.
"""

from __future__ import annotations

import datetime
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def new_run_dir(runs: str | Path, study: str) -> Path:
    """runs/<study>-<UTC timestamp>/, unique even for runs started in the same second."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
    for n in range(1000):
        d = Path(runs) / f"{study}-{stamp}{'' if n == 0 else f'-{n}'}"
        try:
            d.mkdir(parents=True)
            return d
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a fresh run directory under {runs}")


def run_notebook(name: str, parameters: dict, run_dir: str | Path, timeout_s: float = 1800) -> Path:
    """Executes notebooks/<name>.py with `parameters` (plus `out_dir` = run_dir) and writes
    <run_dir>/<name>.ipynb (executed) and <run_dir>/report.html (no input cells, figures inline, titled
    with the study and run id). Returns the report path. The kernel talks over local IPC sockets, not TCP."""
    import jupytext
    import nbformat
    import papermill
    from nbconvert import HTMLExporter
    from traitlets.config import Config

    source = NOTEBOOKS / f"{name}.py"
    if not source.is_file():
        known = sorted(p.stem for p in NOTEBOOKS.glob("*.py"))
        raise ValueError(f"no notebook {name!r}; known: {known}")
    run_dir = Path(run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    nb = jupytext.read(source)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    template = run_dir / f"{name}.template.ipynb"
    executed = run_dir / f"{name}.ipynb"
    nbformat.write(nb, template)
    try:
        papermill.execute_notebook(str(template), str(executed), parameters={**parameters, "out_dir": str(run_dir)},
                                   kernel_name="python3", cwd=str(run_dir), execution_timeout=timeout_s,
                                   progress_bar=False, config=Config({"KernelManager": {"transport": "ipc"}}))
    finally:
        template.unlink(missing_ok=True)
    title = f"{name.replace('_', ' ').capitalize()}: {run_dir.name}"
    html, _ = HTMLExporter(exclude_input=True).from_notebook_node(nbformat.read(executed, as_version=4),
                                                                  resources={"metadata": {"name": title}})
    report = run_dir / "report.html"
    report.write_text(html, encoding="utf-8")
    return report
