# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# llama-cpp-python (the [llamacpp] extra) is compiled by pip: with ggml's CPU backends as dynamically
# loaded variants, one per x86 level, so a wheel cached on one CPU never runs an instruction another
# lacks (specwise loads the best variant at start); a user's own CMAKE_ARGS win
export CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
export CMAKE_BUILD_PARALLEL_LEVEL ?= 2

.PHONY: demo test test-fast interop-check bench clean

# `pip install specwise` is the engine; the lab tools' dependencies are extras (pyproject.toml).
$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e .
	touch $@

# the demo runs the benchmark's comparison code on the real target: engine + [bench]
$(VENV)/.installed-bench: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[bench]"
	touch $@

# the tests cover every layer: [dev] = [bench] + [train] + [qwen] + [serve] + [llamacpp] + the openai client + pytest (+ xdist), hypothesis, scipy, ruff, selenium
$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[dev]"
	@# the page's browser test drives Debian's Chromium; installed where apt can (root), else that test is skipped
	@command -v chromedriver >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		{ apt-get update -q >/dev/null; DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; }; } || \
		echo "note: Chromium not installed; the page's browser test will be skipped"
	touch $@

demo: $(VENV)/.installed-bench
	$(BIN)/specwise demo

# every test runs torch on one thread (tests/conftest.py), so one worker per core (at most 4: each
# real-model file loads its model); a file stays on one worker, so its model is loaded once
test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

test-fast: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile -m "not slow"

# once per machine: builds the speculators and vLLM venvs (each pins its own torch/transformers),
# then runs their checks, failing rather than skipping; then vLLM serves the exports beside specwise
interop-check: $(VENV)/.installed-dev
	SPECWISE_REQUIRE_INTEROP=1 SPECWISE_SPECULATORS_PYTHON="$$(scripts/speculators-env.sh | tail -n 1)" \
		SPECWISE_VLLM_PYTHON="$$(scripts/vllm-env.sh | tail -n 1)" $(BIN)/python -m pytest -q \
		tests/methods/test_vllm_interop.py tests/methods/test_interop.py -k "vllm or speculators_own_loader"
	scripts/vllm-check.sh

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
