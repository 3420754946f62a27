#!/usr/bin/env bash
# Distillation on drifting synthetic ads (docs/results.md): a teacher on an older window, students on a recent
# one, evaluated on the present. Writes runs under $OUT (default runs/distill-drift).
set -euo pipefail
# One thread per run: measured on a shared 2-core machine, where several runs go at once.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
OUT=${OUT:-runs/distill-drift}
GEM=${GEM:-gem}
DATA=(--set data.source=synthetic-ads --set data.max_seq_len=64 --set data.eval_rows=4096
      --set data.options.num_items=2000 --set data.options.num_users=5000
      --set data.options.max_candidates=8 --set data.options.data_seed=0
      --set data.options.drift_weight=0.8 --set data.options.drift_period=1600)
COMMON=(--no-progress --set train.batch_size=64 --set train.eval_every=0
        --set train.checkpoint_every=0 --set train.warmup_steps=10)
# Students: a smaller tiny on chunks 600..600+STEPS-1, evaluated at the end of their window.
STEPS=${STEPS:-300}
STUDENT=(--preset tiny --set model.embedding_dim=16 --set model.num_layers=1
         --set model.interaction_dims=[64,32] --set data.options.train_start=600
         --set data.options.eval_time=$((600 + STEPS)) --set train.steps=$STEPS)
# Teacher (skipped when it exists): the tiny preset on chunks 0..399 of the drifting world, evaluated at its own present.
[ -f "$OUT/teacher/summary.json" ] || $GEM train --preset tiny "${DATA[@]}" "${COMMON[@]}" \
    --set data.options.eval_time=400 --set train.steps=400 \
    --out "$OUT/teacher"
for seed in ${SEEDS:-1 2 3}; do
  [ -f "$OUT/none-$seed/summary.json" ] || $GEM train "${STUDENT[@]}" "${DATA[@]}" \
      "${COMMON[@]}" --set train.seed=$seed --out "$OUT/none-$seed"
  [ -f "$OUT/plain-$seed/summary.json" ] || $GEM distill --teacher "$OUT/teacher" \
      "${STUDENT[@]}" "${DATA[@]}" "${COMMON[@]}" --set train.seed=$seed --out "$OUT/plain-$seed"
  [ -f "$OUT/adapter-$seed/summary.json" ] || $GEM distill --teacher "$OUT/teacher" --adapter \
      --set distill.adapter.fit_batches=20 "${STUDENT[@]}" "${DATA[@]}" "${COMMON[@]}" \
      --set train.seed=$seed --out "$OUT/adapter-$seed"
done
# The table of docs/results.md: eval NE at the present per run, the teacher's NE there (raw and
# through the adapter, from the students' summaries) and the achievable NE.
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def summary(name):
    return json.loads((out / name / "summary.json").read_text())
for kind in ("none", "plain", "adapter"):
    for task in ("click", "conversion"):
        values = [summary(f"{kind}-{s}")["eval"][task]["ne"] for s in (1, 2, 3)]
        print(kind, task, " / ".join(f"{v:.4f}" for v in values), f"mean {sum(values) / 3:.4f}")
plain, adapted = summary("plain-1")["distill"], summary("adapter-1")["distill"]
print("teacher at the present (raw)", plain["teacher_eval_ne"]["raw"])
print("teacher at the present (adapted, seed 1)", adapted["teacher_eval_ne"]["adapted"])
print("adapter fit", adapted["adapter"]["fit"])
print("achievable at the present", summary("none-1")["data"]["achievable_ne"])
print("teacher at its own present", {t: v["ne"] for t, v in summary("teacher")["eval"].items()})
PY
