PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench browser

install: $(STAMP)

# torch first: the pinned CPU build; an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

serve: install
	$(BIN)/docqa serve

# the browser tests drive Debian's headless Chromium through chromedriver
BROWSER_PKGS := chromium chromium-driver

browser:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends $(BROWSER_PKGS); \
	else echo "the browser tests need: apt-get install $(BROWSER_PKGS)"; fi

test: install browser
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: install
	$(BIN)/python bench/ttft.py
