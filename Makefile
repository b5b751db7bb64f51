# The two commands of the README: `make demo` and `make test`. Both create .venv first.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first and pinned: an unpinned torch would pull gigabytes of CUDA packages
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[torch,test,highs,transformers,lightning]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/memplan demo

test: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/python -m pytest -n auto --dist worksteal -m "not slow"

test-all: $(STAMP)
	$(BIN)/ruff check src tests bench examples
	$(BIN)/python -m pytest -n auto --dist worksteal

lint: $(STAMP)
	$(BIN)/ruff check src tests bench examples

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
