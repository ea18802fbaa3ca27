VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: setup test synth clean

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

clean:
	rm -rf $(VENV) runs
