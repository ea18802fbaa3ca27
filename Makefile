VENV := .venv
PY := $(VENV)/bin/python
# Installs skip byte-compiling (more than half of a fresh setup's time, mostly for modules nothing imports);
# Python writes the bytecode of what is imported on first use, so recipes may write it.
INSTALL := $(PY) -m pip install --quiet --no-compile
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup test synth serve study lab clean

$(PY):
	python3 -m venv $(VENV)
	$(INSTALL) --upgrade pip

# Installs are stamped: a target reinstalls only when pyproject.toml (or the reference pins) changed.
# The package is editable, so code changes never need one.
$(VENV)/.core: pyproject.toml | $(PY)
	$(INSTALL) -e .
	touch $@

$(VENV)/.study: pyproject.toml | $(PY)
	$(INSTALL) -e ".[study]"
	touch $@

$(VENV)/.lab: pyproject.toml | $(PY)
	$(INSTALL) -e ".[study,lab]"
	touch $@

$(VENV)/.dev: pyproject.toml requirements-reference.txt | $(PY)
	$(INSTALL) -e ".[dev]"
	$(INSTALL) -r requirements-reference.txt
	$(INSTALL) --no-deps qwen-tts==0.1.1
	touch $@

setup: $(VENV)/.dev

# The slowest tests are listed at the end, so a slow one is seen before the suite outgrows CI.
# Two workers (a 2-core CI machine; more only where there are cores), each taking whole files (module fixtures
# are built once), in the order tests/conftest.py gives them (slowest first).
test: setup
	$(PY) -m pytest -q --durations=15 -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder

synth: $(VENV)/.core
	$(VENV)/bin/qtts-jax synth --model tiny-random --text "$(or $(TEXT),Hello from qtts-jax.)" --out $(or $(OUT),runs/hello.wav)

# Speech server (OpenAI-compatible HTTP + WebSocket); MODEL=DIR|tiny-random, PORT, SLOTS, HOST
serve: $(VENV)/.core
	$(VENV)/bin/qtts-jax serve --model $(or $(MODEL),tiny-random) --host $(or $(HOST),127.0.0.1) --port $(or $(PORT),8000) --slots $(or $(SLOTS),8)

# Capacity study: a batched (2 slots) and a serialised tiny-random server on 127.0.0.1 side by side (or URL=...);
# runs/<id>/report.html. Unset LOADS/REQUESTS/MAX_FRAMES/SLOTS take the CLI's defaults (`qtts-jax study capacity --help`).
# CHUNKS defaults to one-frame chunks: on a 2-core CPU a 2-slot step takes ~53 ms, so a 2-frame chunk lands
# ~106 ms after the 80 ms before it started playing and every stream starves by construction, which would put
# the verdict on the 100 ms starvation line and let two runs disagree.
study: $(VENV)/.study
	$(PY) -m studies capacity $(if $(URL),--url $(URL),--compare-serialised) $(if $(LOADS),--loads $(LOADS)) \
		$(if $(REQUESTS),--requests $(REQUESTS)) $(if $(MAX_FRAMES),--max-frames $(MAX_FRAMES)) \
		$(if $(SLOTS),--slots $(SLOTS)) --chunk-schedule $(or $(CHUNKS),1)

# JupyterLab on notebooks/: the jupytext .py files open as notebooks and stay the source (notebooks/jupytext.toml)
# (--allow-root only when run as root, as in containers)
lab: $(VENV)/.lab
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

clean:
	rm -rf $(VENV) runs
