#!/usr/bin/env bash
# The one prepared GPU check (DESIGN.md section 7): on a lent GPU, in under 8 minutes,
#   1. uses only the image's own torch 2.11 / triton 3.6 (no fbgemm, no torchrec, no package
#      registry) plus pluggy/attrs/numpy, with gem-core and gem-kernels from this checkout;
#   2. checks the triton and reference attention backends in bf16 against the float64 reference;
#   3. measures the device's bf16 matmul rate and copy bandwidth;
#   4. times forward+backward of each shape at Zipf(1.2) lengths next to padded SDPA;
#   5. E2E training (gem_kernels.bench.gpu_e2e): throughput and local MFU of `small` and a
#      shortened `large`, eager / compiled / compiled + CUDA graphs, bf16 and fp8-auto (NE drift
#      against bf16), fbgemm-tbe embeddings when fbgemm_gpu is importable; one subprocess per
#      run, runs that do not fit the budget listed as skipped;
#   6. prints the kernel table, then the E2E table, then which sections failed.
# The kernel checks and the E2E runs are separate sections with their own time limits: one that
# fails or runs out of time does not stop the other. Raw JSON: gpu_check.json, gpu_e2e.json.
#
# Usage, from anywhere:  tools/gpu_check.sh
#   OUT=DIR                     where the JSON and text reports go (default: ./gpu_check_out)
#   PYTHON=python3              the interpreter that has the image's torch and triton
#   GPU_CHECK_LIMIT_S=170       hard limit of the kernel checks, in seconds (104 s on 2026-11-29)
#   GPU_CHECK_E2E_S=270         hard limit of the E2E runs (no run starts in its last 20 s)
#   GPU_CHECK_EMBEDDING=NAME    embedding backend of the E2E runs (default: fbgemm-tbe if
#                               fbgemm_gpu is importable, else reference, recorded)
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_SIZE=tiny   dry run on a CPU (kernels interpreted; E2E trains
#                               only tiny eager bf16 and validates the other configurations)
#   GEM_WHEELS=DIR              wheels of pluggy/attrs/numpy (required) and of tqdm, tensorboard
#                               (with absl-py, protobuf) and torchao (the E2E runs' trainer and
#                               fp8-auto) to install offline
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-$ROOT/gpu_check_out}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
SIZE="${GPU_CHECK_SIZE:-full}"
if [[ "$DEVICE" == "cuda" ]]; then default_limit=170; default_e2e=270; else default_limit=450; default_e2e=240; fi
LIMIT_S="${GPU_CHECK_LIMIT_S:-$default_limit}"
E2E_S="${GPU_CHECK_E2E_S:-$default_e2e}"
E2E_RUNS="$(mktemp -d "${TMPDIR:-/tmp}/gem_e2e_runs.XXXXXX")"  # run dirs: not shipped back
WHEELS="${GEM_WHEELS:-$ROOT/shared/wheels}"
mkdir -p "$OUT_DIR"
start=$(date +%s)

if [[ "$DEVICE" == "cuda" ]]; then
  # Compiled kernels on the GPU; the interpreter is for CPU runs only.
  unset TRITON_INTERPRET
else
  export TRITON_INTERPRET=1
fi

echo "== environment"
"$PY" - "$DEVICE" <<'EOF'
import sys
import torch
import triton
print(f"python {sys.version.split()[0]}  torch {torch.__version__}  triton {triton.__version__}")
if sys.argv[1] == "cuda":
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device visible; for a CPU dry run set GPU_CHECK_DEVICE=cpu")
    print(f"device {torch.cuda.get_device_name()}")
EOF

# gem-core and gem-kernels are used straight from this checkout (PYTHONPATH): the check builds
# its backends directly, so it needs neither an install nor entry points, and never lets pip
# touch the image's torch. Their few pure-Python dependencies must be importable.
# The E2E runs also use gem-precision (bf16, fp8-auto) the same way.
export PYTHONPATH="$ROOT/packages/gem-core/src:$ROOT/packages/gem-kernels/src:$ROOT/packages/gem-precision/src${PYTHONPATH:+:$PYTHONPATH}"
missing=$("$PY" -c '
import importlib.util
print(" ".join(m for m in ("pluggy", "attrs", "numpy") if importlib.util.find_spec(m) is None))')
if [[ -n "$missing" ]]; then
  if [[ -d "$WHEELS" ]]; then
    echo "== installing $missing from $WHEELS (offline)"
    "$PY" -m pip install --no-index --find-links "$WHEELS" $missing
  else
    echo "gpu_check: missing Python packages: $missing; put their wheels in $WHEELS" >&2
    exit 2
  fi
fi

# Optional packages of the E2E section: installed from the wheels when they are there; without
# torchao the fp8-auto runs fail on their own, each with the import error; without tqdm and
# tensorboard the runs log plain progress lines and write no TensorBoard events.
optional=$("$PY" -c '
import importlib.util
print(" ".join(m for m in ("tqdm", "tensorboard", "torchao") if importlib.util.find_spec(m) is None))')
if [[ -n "$optional" ]]; then
  if [[ -d "$WHEELS" ]] && "$PY" -m pip install --no-index --find-links "$WHEELS" $optional; then
    echo "== installed $optional from $WHEELS (offline)"
  else
    echo "gpu_check: $optional not importable: E2E runs needing them will fail (wheels in $WHEELS)"
  fi
fi

# Progress and failures go to stderr as they happen; the tables (stdout) are printed last.
set +e
echo "== section kernels: correctness, peaks and benchmark (limit ${LIMIT_S}s)"
timeout "$LIMIT_S" "$PY" -m gem_kernels.bench.gpu_check --device "$DEVICE" --size "$SIZE" \
  --out "$OUT_DIR/gpu_check.json" > "$OUT_DIR/gpu_check.txt"
kernels_status=$?
echo "== section e2e: training throughput and MFU (limit ${E2E_S}s)"
timeout "$E2E_S" "$PY" -m gem_kernels.bench.gpu_e2e run --device "$DEVICE" --size "$SIZE" \
  ${GPU_CHECK_EMBEDDING:+--embedding "$GPU_CHECK_EMBEDDING"} --budget-s $(( E2E_S - 20 )) \
  --out "$OUT_DIR/gpu_e2e.json" --workdir "$E2E_RUNS" > "$OUT_DIR/gpu_e2e.txt"
e2e_status=$?
rm -rf "$E2E_RUNS"
set -e
echo "== done in $(( $(date +%s) - start )) s; reports in $OUT_DIR"
cat "$OUT_DIR/gpu_check.txt" "$OUT_DIR/gpu_e2e.txt"
failed=""
if [[ $kernels_status -ne 0 ]]; then
  failed+=" kernels(status $kernels_status: 1 = a case or section failed, 124 = time limit)"
fi
if [[ $e2e_status -ne 0 ]]; then
  failed+=" e2e(status $e2e_status: 1 = a run failed, see FAIL e2e lines; 124 = time limit)"
fi
if [[ -n "$failed" ]]; then
  echo "gpu_check: FAILED sections:$failed"
  exit 1
fi
echo "gpu_check: all sections passed"
