# The two commands a newcomer needs: `make test` and `make demo`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: test check demo demo-es install lint clean espeak chromium demo-data

# espeak-ng synthesizes the speech some tests and the demo use: installed only when missing and
# when we may (root with apt); otherwise those tests skip and say why.
espeak:
	@command -v espeak-ng >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng >/dev/null) \
	      || echo "warning: could not install espeak-ng; speech tests will skip"; \
	  else echo "note: espeak-ng is missing: run 'sudo apt-get install espeak-ng' for the speech tests and the demo"; fi; }

# The demo's text and guard speech come from Debian packages (no text or audio lives in the repo):
# fortunes and fortunes-es (natural English and Spanish sentences for the corpora: `asrforge demo`
# and `asrforge demo --language es`) and asterisk-core-sounds-en-wav (real human speech for the
# forgetting guard). Installed the same way as espeak-ng.
DEMO_PACKAGES := fortunes fortunes-es asterisk-core-sounds-en-wav
demo-data:
	@test -f /usr/share/games/fortunes/wisdom && test -f /usr/share/games/fortunes/es/vida.fortunes \
	  && test -d /usr/share/asterisk/sounds/en_US_f_Allison || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(DEMO_PACKAGES) >/dev/null) \
	      || echo "warning: could not install $(DEMO_PACKAGES); the demos and their tests will not run"; \
	  else echo "note: run 'sudo apt-get install $(DEMO_PACKAGES)' for the demos and their tests"; fi; }

# Headless Chromium renders the matrix report in its tests: installed the same way as espeak-ng.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	      || echo "warning: could not install chromium; the report's browser tests will skip"; \
	  else echo "note: chromium is missing: run 'sudo apt-get install chromium' for the report's browser tests"; fi; }

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first: the CPU build that lies on disk; a plain `torch` would pull a multi-GB CUDA build.
	$(BIN)/pip install -q $(TORCH)
	# dev: the test tools and optional libraries; demo: what the demo and its corpus need
	$(BIN)/pip install -q -e '.[dev,demo]'
	@touch $(STAMP)

install: $(STAMP)

test: $(STAMP) espeak chromium demo-data
	$(BIN)/ruff check asrforge tests bench
	$(BIN)/python -m pytest -q --durations=25 tests

# The fast tier, after every change: lint and the tests marked fast, on every core (under 90 s on
# two). It installs nothing beyond the venv; tests that need espeak-ng or chromium skip without them.
check: $(STAMP)
	$(BIN)/ruff check asrforge tests bench
	$(BIN)/python -m pytest -q -m fast -n auto -p no:randomly tests

demo: $(STAMP) espeak demo-data
	$(BIN)/asrforge demo

# The new-language demo: tiny.en taught Spanish under a guard on English (docs/new-language.md).
demo-es: $(STAMP) espeak demo-data
	$(BIN)/asrforge demo --language es

lint: $(STAMP)
	$(BIN)/ruff check asrforge tests bench
	$(BIN)/ruff format --check asrforge tests bench

clean:
	rm -rf $(VENV) runs .pytest_cache
