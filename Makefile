# The two commands a newcomer needs: `make test` and `make demo`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: test check demo demo-es demo-multilingual install lint clean espeak chromium demo-data

# espeak-ng synthesizes the speech some tests and the demo use: installed only when missing and
# when we may (root with apt); otherwise those tests skip and say why.
espeak:
	@command -v espeak-ng >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng >/dev/null) \
	      || echo "warning: could not install espeak-ng; speech tests will skip"; \
	  else echo "note: espeak-ng is missing: run 'sudo apt-get install espeak-ng' for the speech tests and the demo"; fi; }

# The demo's text and guard speech come from Debian packages (no text or audio lives in the repo):
# fortunes, fortunes-es and fortunes-it (natural English, Spanish and Italian sentences for the
# corpora: `asrforge demo`, `--language es` and `--multilingual`) and asterisk-core-sounds-XX-wav
# with their transcripts in asterisk-core-sounds-XX (real human speech in five languages for the
# forgetting guards and rehearsal). Installed the same way as espeak-ng.
ASTERISK := en es fr it ru
DEMO_PACKAGES := fortunes fortunes-es fortunes-it $(foreach l,$(ASTERISK),asterisk-core-sounds-$(l)-wav asterisk-core-sounds-$(l))
demo-data:
	@test -f /usr/share/games/fortunes/wisdom && test -f /usr/share/games/fortunes/es/vida.fortunes \
	  && test -f /usr/share/games/fortunes/it/leggi \
	  && test -f /usr/share/doc/asterisk-core-sounds-ru/core-sounds-ru.txt.gz \
	  && test -d /usr/share/asterisk/sounds/ru_RU_f_IvrvoiceRU \
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

# Whisper base taught Spanish and Italian under a guard of real speech in five languages.
demo-multilingual: $(STAMP) espeak demo-data
	$(BIN)/asrforge demo --multilingual

lint: $(STAMP)
	$(BIN)/ruff check asrforge tests bench
	$(BIN)/ruff format --check asrforge tests bench

clean:
	rm -rf $(VENV) runs .pytest_cache
