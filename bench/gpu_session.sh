#!/usr/bin/env bash
# A lent GPU session's whole check in one device call: gpu_check.py's training and evaluation
# rows, then gpu_eval_parts.py's breakdown of a base evaluation, each part under its own time
# limit so that one which hangs costs only its share. Files land in $OUT (the device tool's
# folder; default /tmp/gpu-session): gpu_check.md/.json/.log, eval_parts.txt/.log.
#
# Here first, once:  bench/gpu_wheels.sh      (the wheels the GPU image lacks, into .whl/)
# Device call:       bash bench/gpu_session.sh    with carry [".whl"] and timeout_s 540
# On a CPU, the same logic in seconds:  QUICK=1 bench/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-session}
PY=${PY:-python3}
mkdir -p "$OUT"
if [ -z "${QUICK:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:.
  nvidia-smi -L
  # 64 clips a side: with 32 the loader's start weighed on every evaluation row
  check=(--eval-n 64 --eval-n-auto 128)
  parts=(--shape base)
else
  export PYTHONPATH=${PYTHONPATH:-.}
  check=(--device cpu --quick --warmup 1 --steps 2)
  parts=(--device cpu --quick)
fi
export PYTHONUNBUFFERED=1
timeout 420 "$PY" bench/gpu_check.py "${check[@]}" --budget-seconds 380 \
  --out "$OUT/gpu_check.md" > "$OUT/gpu_check.log" 2>&1
echo "gpu_check: exit $?"
timeout 90 "$PY" bench/gpu_eval_parts.py "${parts[@]}" --out "$OUT/eval_parts.txt" \
  > "$OUT/eval_parts.log" 2>&1
echo "gpu_eval_parts: exit $?"
cat "$OUT/gpu_check.md" "$OUT/eval_parts.txt" 2>/dev/null
