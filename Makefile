# The two commands a newcomer needs: `make test` and `make demo`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: test demo install lint clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first: the CPU build that lies on disk; a plain `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/ruff check asrforge tests bench
	$(BIN)/python -m pytest -q tests

demo: $(STAMP)
	$(BIN)/asrforge train configs/tiny.yaml

lint: $(STAMP)
	$(BIN)/ruff check asrforge tests bench
	$(BIN)/ruff format --check asrforge tests bench

clean:
	rm -rf $(VENV) runs .pytest_cache
