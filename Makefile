VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0

.PHONY: install serve test bench clean

# A project-local venv with shoal installed (editable) and `shoal` on its PATH.
# torch is pinned first: an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==$(TORCH_VERSION)
	$(PIP) install -e '.[test]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/shoal serve

test: install
	$(VENV)/bin/python -m pytest -q

bench: install
	$(PY) tests/bench/bench_engine.py

clean:
	rm -rf $(VENV) build *.egg-info
