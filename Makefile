# Two commands on a fresh machine: `make demo` (a forecast) and `make test` (the test suite).
# Both create .venv and install everything; torch is the CPU build 2.13.0 (never a CUDA build).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/neusight-predict model=gpt2-large device=h100-sxm5-80gb batch_size=4 seq_len=1024 mode=training

test: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -n auto

clean:
	rm -rf $(VENV) outputs multirun
