VENV := .venv
PY := $(VENV)/bin/python
# Installs skip byte-compiling (more than half of a fresh setup's time, mostly for modules nothing imports);
# Python writes the bytecode of what is imported on first use, so recipes may write it.
INSTALL := $(PY) -m pip install --quiet --no-compile
unexport PYTHONDONTWRITEBYTECODE

.PHONY: help setup setup-gpu browser test test-fleet cluster synth serve study report explore lab clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 12

$(PY):
	python3 -m venv $(VENV)
	$(INSTALL) --upgrade pip

# Installs are stamped: a target reinstalls only when pyproject.toml (or the reference pins) changed.
# The package is editable, so code changes never need one.
# A bigger install satisfies a smaller one. `make synth` after `make test` uses the .dev stamp (it holds the package),
# so it installs nothing. $(call stamp,OWN OTHERS...): the first of these stamps that exists, else OWN's.
stamp = $(or $(firstword $(wildcard $(addprefix $(VENV)/.,$(1)))),$(VENV)/.$(firstword $(1)))
CORE := $(call stamp,core dev fleet study lab cuda)
STUDY := $(call stamp,study dev fleet lab)
$(VENV)/.core: pyproject.toml | $(PY)
	$(INSTALL) -e .
	touch $@

$(VENV)/.study: pyproject.toml | $(PY)
	$(INSTALL) -e ".[study]"
	touch $@

$(VENV)/.cuda: pyproject.toml | $(PY)
	$(INSTALL) -e ".[cuda]"
	touch $@

$(VENV)/.lab: pyproject.toml | $(PY)
	$(INSTALL) -e ".[study,lab]"
	touch $@

$(VENV)/.fleet: pyproject.toml $(VENV)/.dev
	$(INSTALL) -e ".[dev,fleet]"
	touch $@

$(VENV)/.dev: pyproject.toml requirements-reference.txt | $(PY)
	$(INSTALL) -e ".[dev]"
	$(INSTALL) -r requirements-reference.txt
	$(INSTALL) --no-deps qwen-tts==0.1.1
	touch $@

setup: $(VENV)/.dev  ## everything the tests need (the package, the reference, PyTorch on CPU)

setup-gpu: $(VENV)/.cuda  ## JAX's CUDA build (the cuda extra), for an NVIDIA GPU

# Debian's chromium and chromedriver for tests/test_page.py, installed when missing and we are root (as in CI and
# containers); otherwise it says what to install, and the browser tests skip outside CI (in CI they must run).
browser:  ## chromium + chromedriver for the page's browser tests (apt-get, as root)
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			chromium chromium-driver >/dev/null; \
	else echo "make browser: install chromium and chromium-driver (Debian) to run the page's browser tests"; fi

# The slowest tests are listed at the end, so a slow one is seen before the suite outgrows CI.
# Two workers (a 2-core CI machine; more only where there are cores), each taking whole files (module fixtures
# are built once), in the order tests/conftest.py gives them (slowest first).
test: setup browser  ## the test suite (2 workers; the 15 slowest listed at the end)
	$(PY) -m pytest -q --durations=15 -n auto --maxprocesses 4 --dist loadfile --no-loadscope-reorder -m "not fleet"

# The Ray Serve fleet's tests (tests/test_fleet.py): two tiny-random CPU replicas in one local Ray instance, in one
# process (Ray takes the cores); the fleet extra (ray[serve]) is installed only here. CI runs it as its own job after
# `make test` (.ci/run), outside the suite's 10-minute budget
test-fleet: $(VENV)/.fleet  ## the fleet's tests on CPU replicas (installs the fleet extra)
	$(PY) -m pytest -q --durations=5 -m fleet tests/test_fleet.py

# MODEL=DIR|tiny-random; without MAX_FRAMES a real model ends on its own and random weights (which rarely end)
# stop after the CLI's 24 frames (1.9 s)
synth: $(CORE)  ## one file: TEXT="..." OUT=runs/hello.wav [MODEL=DIR] [MAX_FRAMES=N] [VOICE=serena]
	$(VENV)/bin/qtts-jax synth --model $(or $(MODEL),tiny-random) --text "$(or $(TEXT),Hello from qtts-jax.)" \
		--out $(or $(OUT),runs/hello.wav) $(if $(MAX_FRAMES),--max-frames $(MAX_FRAMES)) $(if $(VOICE),--speaker $(VOICE))

# Speech server (OpenAI-compatible HTTP + WebSocket, the page at /); MODEL=DIR|tiny-random, PORT, SLOTS, HOST, DTYPE
serve: $(CORE)  ## the speech server and its page: http://127.0.0.1:8000/ [MODEL=DIR] [SLOTS=8|auto] [PORT] [DTYPE]
	$(VENV)/bin/qtts-jax serve --model $(or $(MODEL),tiny-random) --host $(or $(HOST),127.0.0.1) --port $(or $(PORT),8000) \
		--slots $(or $(SLOTS),8) $(if $(DTYPE),--dtype $(DTYPE))

# The same API from a Ray Serve fleet of engine replicas (a local Ray instance); REPLICAS, MODEL, PORT, SLOTS
cluster: $(VENV)/.fleet  ## a Ray Serve fleet: http://127.0.0.1:8000/ [REPLICAS=2] [MODEL=DIR] [SLOTS=8] [PORT]
	$(VENV)/bin/qtts-jax cluster --model $(or $(MODEL),tiny-random) --replicas $(or $(REPLICAS),2) \
		--host $(or $(HOST),127.0.0.1) --port $(or $(PORT),8000) --slots $(or $(SLOTS),8)

# Capacity study: a batched (2 slots) and a serialised tiny-random server on 127.0.0.1 side by side (or URL=...);
# runs/<id>/report.html. Unset LOADS/REQUESTS/MAX_FRAMES/SLOTS take the CLI's defaults (`qtts-jax study capacity --help`).
# CHUNKS defaults to one-frame chunks: on a 2-core CPU a 2-slot step takes ~53 ms, so a 2-frame chunk lands
# ~106 ms after the 80 ms before it started playing and every stream starves by construction, which would put
# the verdict on the 100 ms starvation line and let two runs disagree.
# PRICE: USD per replica-hour for the fleet's cost (unset: the CLI's default, which the report names as such).
study: $(STUDY)  ## capacity study -> runs/<id>/report.html [URL=http://host:port] [LOADS="1 2 4"] [PRICE=USD/h]
	$(PY) -m studies capacity $(if $(URL),--url $(URL),--compare-serialised) $(if $(LOADS),--loads $(LOADS)) \
		$(if $(REQUESTS),--requests $(REQUESTS)) $(if $(MAX_FRAMES),--max-frames $(MAX_FRAMES)) \
		$(if $(SLOTS),--slots $(SLOTS)) $(if $(PRICE),--price-per-hour $(PRICE)) --chunk-schedule $(or $(CHUNKS),1)

# A study measured where the server runs (`python -m studies capacity --url ... --no-report`, e.g. on a GPU host
# without papermill), rendered here from its run directory
report: $(STUDY)  ## render a run's report.html from its records: RUN=runs/<id>
	$(PY) -m studies report $(or $(RUN),$(error RUN=runs/<id> is required))

# One synthesis through a server (a local tiny-random one unless URL=...): listen, waveform, spectrogram, timings
explore: $(STUDY)  ## notebooks/explore_model.py -> runs/<id>/report.html [TEXT=...] [URL=...] [MODEL=DIR]
	$(PY) -m studies explore $(if $(URL),--url $(URL)) $(if $(MODEL),--model $(MODEL)) $(if $(TEXT),--text "$(TEXT)")

# JupyterLab on notebooks/: the jupytext .py files open as notebooks and stay the source (notebooks/jupytext.toml)
# (--allow-root only when run as root, as in containers)
lab: $(VENV)/.lab  ## JupyterLab on notebooks/
	$(VENV)/bin/jupyter lab --notebook-dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

clean:  ## remove .venv and runs/
	rm -rf $(VENV) runs
