# The README's commands: `make train` (set up, then train the default preset) and `make test`
# (set up, then run the whole test suite). Set-up is idempotent: it reinstalls only when a
# requirements or pyproject file changed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# Which build of torch and fbgemm: cpu (the default) or cuda; requirements/$(FLAVOUR).txt pins it.
# Switching the flavour of an existing .venv needs `make clean` first (pip keeps an installed
# torch 2.13.0+cpu when asked for torch==2.13.0).
FLAVOUR ?= cpu
# The package index torch (and, for cuda, fbgemm-gpu) is looked up on besides PyPI. cpu: PyTorch's
# CPU index, where torch 2.13.0+cpu is published. cuda: none (PyPI's torch 2.13.0 is the CUDA 13
# build); set e.g. https://download.pytorch.org/whl/cu126 for CUDA 12.6 (pip prefers its
# 2.13.0+cu126 over PyPI's 2.13.0). A mirror works too.
TORCH_INDEX_cpu := https://download.pytorch.org/whl/cpu
TORCH_INDEX ?= $(TORCH_INDEX_$(FLAVOUR))
PACKAGES := gem-core[test,tensorboard,progress] gem-data[duckdb,spark] gem-kernels[triton,fbgemm-$(FLAVOUR)] \
            gem-parallel[torchrec,deepspeed] gem-precision[fp8]
STAMP := $(VENV)/.installed-$(FLAVOUR)
FLAVOUR_FILE := requirements/$(FLAVOUR).txt
ifeq ($(wildcard $(FLAVOUR_FILE)),)
$(error FLAVOUR=$(FLAVOUR): there is no $(FLAVOUR_FILE); use FLAVOUR=cpu or FLAVOUR=cuda)
endif
INPUTS := requirements/stack.txt $(FLAVOUR_FILE) requirements/fbgemm-gpu-cpu-alias/pyproject.toml \
          $(wildcard packages/*/pyproject.toml) Makefile
# the flavour file's torch and fbgemm-gpu pins (fbgemm-gpu-cpu is on PyPI)
TORCH_PINS = $(shell grep -E '^(torch|fbgemm-gpu)==' $(FLAVOUR_FILE))

# CPU test environment: Triton kernels run in its interpreter; DeepSpeed's JIT op is cached
# inside the repository's ignored cache folder so it is built once.
export TRITON_INTERPRET ?= 1
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: setup browser train test test-fast bench clean

setup: $(STAMP)

$(STAMP): $(INPUTS)
	@for other in $(VENV)/.installed-*; do \
	  test ! -e "$$other" -o "$$other" = "$(STAMP)" || \
	  { echo "$(VENV) holds another flavour ($$other): run make clean first"; exit 2; }; done
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first, alone, from TORCH_INDEX (one look-up there, not one per package: an index
	# that cannot be reached costs pip's retries for every name it is asked about)
	$(BIN)/pip install --quiet --no-deps $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) \
	  $(TORCH_PINS)
	# deepspeed's setup imports torch, so it is built without isolation, after torch
	$(BIN)/pip install --quiet -r $(FLAVOUR_FILE) setuptools wheel
	# then the rest of the stack and the five packages (editable) with their extras, resolved
	# together, so the packages' own pins are checked against the stack's
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet --no-build-isolation \
	  -r $(FLAVOUR_FILE) -r requirements/stack.txt $(foreach p,$(PACKAGES),-e 'packages/$(p)')
	mkdir -p .cache/torch_extensions
	touch $(STAMP)

train: setup
	$(BIN)/gem train $(ARGS)

# The report test renders pages in Debian's headless Chromium; where it cannot be installed
# (no root, no apt) that one test skips and says why.
browser:
	@command -v chromium >/dev/null 2>&1 || \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
	  >/dev/null 2>&1 || echo "chromium could not be installed: the browser test will skip"

# The suite runs on TEST_WORKERS pytest-xdist processes, whole test files to a worker (a module's
# fixtures are built once), with torch on TEST_THREADS threads in every process, the ranks the
# tests launch included: on a busy 2-core machine, processes of two OpenMP threads each spin
# against each other (a 20-step `gem train` beside one other job: 135 s with two threads, 10 s
# with one), and two workers keep both cores busy when it is idle.
TEST_WORKERS ?= 2
TEST_THREADS ?= 1
PYTEST = OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

test: setup browser
	$(PYTEST) $(ARGS)

test-fast: setup
	$(PYTEST) -m "not slow and not distributed" $(ARGS)

bench: setup
	$(BIN)/gem bench $(ARGS)

clean:
	rm -rf $(VENV) .cache runs .pytest_cache .hypothesis
