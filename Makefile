# The README's commands: `make train` (set up, then train the default preset) and `make test`
# (set up, then run the whole test suite). Set-up is idempotent: it reinstalls only when a
# requirements or pyproject file changed.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PACKAGES := gem-core gem-data gem-kernels gem-parallel gem-precision
STAMP := $(VENV)/.installed
INPUTS := requirements/stack.txt $(foreach p,$(PACKAGES),packages/$(p)/pyproject.toml) Makefile

# CPU test environment: Triton kernels run in its interpreter; DeepSpeed's JIT op is cached
# inside the repository's ignored cache folder so it is built once.
export TRITON_INTERPRET ?= 1
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: setup browser train test test-fast bench clean

setup: $(STAMP)

$(STAMP): $(INPUTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch first and alone, so pip takes the local CPU build (DESIGN.md section 5)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -r requirements/stack.txt
	# without --no-deps torchrec pulls the CUDA fbgemm-gpu over fbgemm-gpu-cpu
	$(BIN)/pip install --quiet --no-deps torchrec==1.8.0
	DS_BUILD_OPS=0 $(BIN)/pip install --quiet --no-build-isolation --no-deps deepspeed==0.19.8
	$(BIN)/pip install --quiet --no-build-isolation --no-deps $(foreach p,$(PACKAGES),-e packages/$(p))
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

test: setup browser
	$(BIN)/python -m pytest $(ARGS)

test-fast: setup
	$(BIN)/python -m pytest -m "not slow and not distributed" $(ARGS)

bench: setup
	$(BIN)/gem bench $(ARGS)

clean:
	rm -rf $(VENV) .cache runs .pytest_cache .hypothesis
