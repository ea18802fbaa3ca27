VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup test synth serve study clean

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

setup: $(PY)
	$(PIP) install --quiet -e ".[dev]"
	$(PIP) install --quiet -r requirements-reference.txt
	$(PIP) install --quiet --no-deps qwen-tts==0.1.1

test: setup
	$(PY) -m pytest -q

synth: $(PY)
	$(PIP) install --quiet -e .
	$(VENV)/bin/qtts-jax synth --model tiny-random --text "$(or $(TEXT),Hello from qtts-jax.)" --out $(or $(OUT),runs/hello.wav)

# Speech server (OpenAI-compatible HTTP + WebSocket); MODEL=DIR|tiny-random, PORT, SLOTS, HOST
serve: $(PY)
	$(PIP) install --quiet -e .
	$(VENV)/bin/qtts-jax serve --model $(or $(MODEL),tiny-random) --host $(or $(HOST),127.0.0.1) --port $(or $(PORT),8000) --slots $(or $(SLOTS),8)

# Capacity study: a batched and a serialised tiny-random server on 127.0.0.1 side by side (or URL=...); runs/<id>/report.html
study: $(PY)
	$(PIP) install --quiet -e ".[study]"
	$(PY) -m studies capacity $(if $(URL),--url $(URL),--compare-serialised) --loads $(or $(LOADS),1 2 4) --requests $(or $(REQUESTS),12) --max-frames $(or $(MAX_FRAMES),24)

clean:
	rm -rf $(VENV) runs
