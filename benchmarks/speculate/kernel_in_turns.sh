#!/usr/bin/env bash
# `speculate` with the few-row kernel (A) and with torch's linear (B, DEPTHCURSE_FEW_ROW_KERNEL=0), whole
# processes in turns A B B A, each its own results folder under OUT; prints each run's time and load.
# Each run's speculate.json holds v, the speedup and `check_linear`.
#
#     benchmarks/speculate/kernel_in_turns.sh /tmp/kernel_ab [MODEL] [SKIP]
#
# (issue 89, item 5: docs/benchmarks.md, "A check near one decoding step")
set -euo pipefail
out=${1:?results folder}; model=${2:-smollm2-135m}; skip=${3:-12-15}
cd "$(dirname "$0")/../.."
mkdir -p "$out"
for run in A1 B1 B2 A2; do
  case $run in A*) kernel=1 ;; B*) kernel=0 ;; esac
  start=$(date +%s.%N)
  DEPTHCURSE_FEW_ROW_KERNEL=$kernel .venv/bin/depthcurse speculate "$model" --skip "$skip" --per-kind 2 --max-new-tokens 48 \
    --baselines none --out "$out/$run" > "$out/$run.log" 2>&1
  python3 -c "import json, sys; r = json.load(open(sys.argv[1])); d = r['summary']['drafts']['self-draft']
print(sys.argv[2], 'v', round(d['v']['mean'], 3), d['v']['interval'], 'speedup', d['speedup'], 'lossless', d['lossless']['equal'], 'of', d['lossless']['compared'], '|', r['check_linear'])" \
    "$out/$run/speculate.json" "$run $(echo "$(date +%s.%N) - $start" | bc) s, load $(cut -d' ' -f1 /proc/loadavg)"
done
