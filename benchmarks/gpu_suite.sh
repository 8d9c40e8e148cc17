#!/usr/bin/env bash
# GPU suite: the GPU-marked tests, then the GPU benchmarks, each under its own time limit (the
# limits add up to 7.5 minutes, so the suite stays under 8). Results (JSON, JUnit XML, logs,
# summary.txt) go under $OUT (default ./results). Builds nothing: run it from a checkout whose
# venv is installed, e.g.  OUT=/tmp/out benchmarks/gpu_suite.sh
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${OUT:-results}"
mkdir -p "$OUT"
PY="${PY:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
# Compiled kernels on a GPU: never the interpreter.
unset TRITON_INTERPRET

SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
status=0

# run NAME SECONDS CMD...: CMD's output goes to $OUT/NAME.log; its tail is echoed.
run() {
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    echo "== $name (limit ${limit}s): $*"
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 40 "$OUT/$name.log"
    echo "$name rc=$rc ${limit}s-limit took=$((SECONDS - t0))s" | tee -a "$SUMMARY"
    [ "$rc" -eq 0 ] || status=1
}

# Extra benchmarks written by other modules: pass --out only when the script takes it.
bench() {
    local name=$1 limit=$2 script="benchmarks/$1.py"
    [ -f "$script" ] || { echo "$name: $script not present, skipped" | tee -a "$SUMMARY"; return; }
    if grep -q -- '--out' "$script"; then
        run "$name" "$limit" "$PY" "$script" --out "$OUT/$name.json"
    else
        run "$name" "$limit" "$PY" "$script"
    fi
}

"$PY" - <<'EOF' | tee "$OUT/device.txt"
import torch
print("cuda:", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
EOF

run gpu-tests 150 "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml"
run attention 120 "$PY" benchmarks/attention.py --out "$OUT/attention.json"
bench migration 90
bench compaction 90

echo "summary (total ${SECONDS}s):"
cat "$SUMMARY"
exit "$status"
