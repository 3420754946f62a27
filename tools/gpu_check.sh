#!/usr/bin/env bash
# The one prepared GPU check (DESIGN.md section 7): on a lent GPU, in under 8 minutes,
#   1. uses only the image's own torch 2.11 / triton 3.6 (no fbgemm, no torchrec, no package
#      registry) plus pluggy/attrs/numpy, with gem-core and gem-kernels from this checkout;
#   2. checks the triton and reference attention backends in bf16 against the float64 reference;
#   3. measures the device's bf16 matmul rate and copy bandwidth;
#   4. times forward+backward of each shape at Zipf(1.2) lengths next to padded SDPA;
#   5. prints a short table last (copy it into docs/perf.md).
#
# Usage, from anywhere:  tools/gpu_check.sh
#   OUT=DIR                     where gpu_check.json / gpu_check.txt go (default: ./gpu_check_out)
#   PYTHON=python3              the interpreter that has the image's torch and triton
#   GPU_CHECK_LIMIT_S=450       hard limit of the Python part, in seconds
#   GPU_CHECK_DEVICE=cpu GPU_CHECK_SIZE=tiny   dry run on a CPU (kernels interpreted), for CI
#   GEM_WHEELS=DIR              wheels of pluggy/attrs/numpy to install offline if missing
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
OUT_DIR="${OUT:-$ROOT/gpu_check_out}"
LIMIT_S="${GPU_CHECK_LIMIT_S:-450}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
SIZE="${GPU_CHECK_SIZE:-full}"
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
export PYTHONPATH="$ROOT/packages/gem-core/src:$ROOT/packages/gem-kernels/src${PYTHONPATH:+:$PYTHONPATH}"
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

echo "== correctness, peaks and benchmark (limit ${LIMIT_S}s)"
# Progress and failures go to stderr as they happen; the table (stdout) is printed last.
set +e
timeout "$LIMIT_S" "$PY" -m gem_kernels.bench.gpu_check --device "$DEVICE" --size "$SIZE" \
  --out "$OUT_DIR/gpu_check.json" > "$OUT_DIR/gpu_check.txt"
status=$?
set -e
echo "== done in $(( $(date +%s) - start )) s; exit status $status; report in $OUT_DIR"
if [[ $status -ne 0 ]]; then
  echo "gpu_check: FAILED (status $status: 1 = a correctness case failed, 124 = time limit)"
fi
cat "$OUT_DIR/gpu_check.txt"
exit "$status"
