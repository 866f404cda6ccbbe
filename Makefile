# turnkv: two commands do all the set-up on a fresh machine: `make demo` and `make test`.
# Each creates or reuses .venv; a second run skips every step whose inputs did not change.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The stamp changes whenever a pin or a dependency list changes, so the venv is refreshed then.
READY := $(VENV)/.turnkv-ready
DEPS := pyproject.toml turnkv/versions.py $(wildcard requirements/*.txt)
EXTRAS ?= engines,infra,dev,peers
PYTEST_ARGS ?=

.PHONY: setup demo test lint unit e2e infra-test clean down tools synth aiperf

setup: $(READY)

$(READY): $(DEPS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(PYTHON) -m turnkv.versions --write >/dev/null
	$(BIN)/python -m pip install -q --disable-pip-version-check -U pip
	$(BIN)/python -m pip install -q --disable-pip-version-check -e '.[$(EXTRAS)]'
	$(BIN)/python -m turnkv.local.engine_env
	@touch $@

# Test-only tools from Debian (package name = command name), installed when missing.
APT_TOOLS := redis-server shellcheck
tools:
	@missing=""; for t in $(APT_TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -n "$$missing" ]; then echo "installing$$missing (apt)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	  || { echo "could not install$$missing: install it with your package manager"; exit 1; }; fi

# The pinned AWS CDK CLI (package-lock.json) for `make synth` and the CLI test.
CDK := node_modules/.bin/cdk
$(CDK): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	@touch $@

synth: setup $(CDK)
	JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION=20 $(CDK) synth --quiet

demo: setup
	$(BIN)/turnkv demo --out results/demo

# tests/infra also runs `$(CDK) synth` with CDK_DEFAULT_ACCOUNT set (what `make synth` does on a machine with
# credentials) and the offline deploy rehearsal through moto's CloudFormation.
test: setup tools $(CDK)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .

unit: setup
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

e2e: setup tools
	$(BIN)/python -m pytest tests/e2e tests/e2e_router tests/e2e_push $(PYTEST_ARGS)

# aiperf (bench.aiperf_multiturn) in a venv of its own: its pins differ from vLLM's.
AIPERF_VENV ?= .venv-aiperf
aiperf: $(AIPERF_VENV)/bin/aiperf
$(AIPERF_VENV)/bin/aiperf: requirements/aiperf.txt
	@test -x $(AIPERF_VENV)/bin/python || $(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/python -m pip install -q --disable-pip-version-check -r requirements/aiperf.txt
	@touch $@

infra-test: setup $(CDK)
	$(BIN)/python -m pytest tests/infra $(PYTEST_ARGS)

down:
	-$(BIN)/turnkv local down

clean: down
	rm -rf $(VENV) .turnkv results cdk.out node_modules
