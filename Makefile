PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench system-deps

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

# what the tests run beside the service: Debian's headless Chromium and chromedriver (the
# page), HAProxy (the load balancer in front of replicas) and docker-compose (`config` checks
# the compose files); installed when missing and make runs as root
SYSTEM_CMDS := chromium chromedriver haproxy docker-compose
SYSTEM_PKGS := chromium chromium-driver haproxy docker-compose

system-deps:
	@missing=; for c in $(SYSTEM_CMDS); do command -v $$c >/dev/null 2>&1 || missing=1; done; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends $(SYSTEM_PKGS); \
	else echo "the tests need: apt-get install $(SYSTEM_PKGS)"; fi

test: install system-deps
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: install
	$(BIN)/python bench/ttft.py
