# ProxyDML: two commands on a fresh machine.
#   make demo  - creates .venv, installs, builds the emoji set, trains ProxyNCA++ on a local Ray cluster
#   make test  - creates .venv, installs, runs the whole test suite (make test-fast: the unit tier)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
PYTEST_ARGS ?=

.PHONY: demo test test-fast install lint bench clean browser postgres

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch/torchvision first and alone: pip takes them from the local wheel store.
	$(BIN)/pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

install: $(STAMP)

# The demo trains ProxyNCA++ on the emoji benchmark (emoji_proxy_nca_pp_demo: the recipe chosen
# to fit 15 minutes on 2 cores), built first from the npm registry (idempotent: a second build
# only verifies); `make demo DEMO=digits` is the one-minute version on scikit-learn's digits.
DEMO ?= emoji_proxy_nca_pp_demo
demo: $(STAMP)
	$(if $(filter emoji_%,$(DEMO)),$(BIN)/proxydml data build emoji,@true)
	$(BIN)/proxydml train --config $(DEMO) $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check proxies pipelines services tests

# The browser tests drive Debian's headless Chromium (never a downloaded browser).
browser:
	test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null)

# The stack's database: Debian's PostgreSQL server (the stack runs its own cluster in its state folder).
postgres:
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null)

test: $(STAMP) browser postgres
	$(BIN)/ruff check proxies pipelines services tests
	$(BIN)/python -m pytest --durations=25 $(PYTEST_ARGS)

# The unit tier, for every edit: no Ray cluster, no servers, no worker processes (< 2 min).
FAST := not ray and not e2e and not emoji and not multiprocess
test-fast: $(STAMP)
	$(BIN)/ruff check proxies pipelines services tests
	$(BIN)/python -m pytest -m "$(FAST)" $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python tests/benchmarks/bench_eval.py
	$(BIN)/python tests/benchmarks/bench_losses.py

clean:
	rm -rf runs mlruns .pytest_cache
