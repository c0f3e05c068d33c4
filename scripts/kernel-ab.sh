#!/usr/bin/env bash
# A lease's first call: the GPU tests of the off-by-default kernel choices, then one A/B per choice against the
# engine's defaults (scripts/ab-decode.py: interleaved, judged by the paired 2-of-3 rule), so that the lease records
# only what pays (docs/game-plan.md, next steps).
#
#   scripts/kernel-ab.sh [STAGE ...]      default: every stage, in this order
#
# Stages (each under its own timeout, so one that hangs costs its limit, not the call):
#   tests      GPU tests of the kernels and of deterministic mode (tests/test_gpu_engine.py, test_gpu_speculate.py)
#   rows       verify_linear=few_rows on the 8B chain cycle (--spec 7,1,8)
#   rows-tree  verify_linear=few_rows on the 8B 32-token tree cycle (--spec 6,4,32)
#   merge      merge=grouped_merge on the 8B chain cycle after a 32K prompt
#   norm       norm_prologue=fused_add_norm on the 1B decode
#   swiglu     swiglu_prologue=fused_swiglu on the 1B decode
# Each A/B writes ab/STAGE.json (the samples, pair ratios and verdict) and ab/STAGE.err in a work folder; the script
# ends with a table: stage, exit, verdict (B against the defaults), and the seconds it took ($OUT/summary.txt), and
# packs the work folder (ab/, gpu-tests.log, gpu.txt, summary.txt) into $OUT/kernel-ab.tgz, also after each stage: a
# lent machine gives back at most 8 files from $OUT, and one stage's two files each would be cut from a full run. It installs the wheels carried in
# .whl/ first, as scripts/gpu-runbooks.sh does. A choice becomes the default, and is recorded, only on `faster`.
# Exit: 0 when every stage ran (whatever the verdicts), 2 for an unknown stage, 3 without a CUDA device.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/kernel-ab}
work=$(mktemp -d "${TMPDIR:-/tmp}/kernel-ab.XXXXXX")
mkdir -p "$out" "$work/ab"
pack() { tar czf "$out/kernel-ab.tgz" -C "$work" . ; }
all=(tests rows rows-tree merge norm swiglu)
stages=("$@")
[ "${#stages[@]}" -gt 0 ] || stages=("${all[@]}")
for s in "${stages[@]}"; do
  [[ " ${all[*]} " == *" $s "* ]] || { echo "unknown stage '$s' (stages: ${all[*]})" >&2; exit 2; }
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$work/gpu.txt" \
  | grep -q . || { echo "no CUDA device here" >&2; exit 3; }

site=${TMPDIR:-/tmp}/site
. scripts/carried-wheels.sh
carried_wheels "$site"
export PYTHONUNBUFFERED=1

ab() {  # STAGE LIMIT ab-decode.py's arguments...
  local stage=$1 limit=$2; shift 2
  timeout "$limit" python3 scripts/ab-decode.py "$@" --json > "$work/ab/$stage.json" 2> "$work/ab/$stage.err"
}

rows=()
for s in "${stages[@]}"; do
  t0=$(date +%s)
  echo "== $(date -u +%T) $s"
  case $s in
    tests) timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py \
             tests/test_gpu_speculate.py > "$work/gpu-tests.log" 2>&1; rc=$?; tail -3 "$work/gpu-tests.log" ;;
    rows) ab rows 150 --b verify_linear=few_rows --spec 7,1,8 --shape llama-3.1-8b; rc=$? ;;
    rows-tree) ab rows-tree 150 --b verify_linear=few_rows --spec 6,4,32 --shape llama-3.1-8b; rc=$? ;;
    merge) ab merge 200 --b merge=grouped_merge --spec 7,1,8 --prompt-len 32768 --new-tokens 64 \
             --shape llama-3.1-8b; rc=$? ;;
    norm) ab norm 120 --b norm_prologue=fused_add_norm --shape llama-3.2-1b; rc=$? ;;
    swiglu) ab swiglu 120 --b swiglu_prologue=fused_swiglu --shape llama-3.2-1b; rc=$? ;;
  esac
  verdict=-
  [ -s "$work/ab/$s.json" ] && verdict=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["verdict"])' \
    "$work/ab/$s.json" 2>/dev/null || echo unreadable)
  [ "$rc" -eq 124 ] && verdict="cut at its limit"
  [ "$s" = tests ] && verdict=$([ "$rc" -eq 0 ] && echo passed || echo failed)
  rows+=("$(printf '%-10s %4s  %-18s %5ss' "$s" "$rc" "$verdict" "$(( $(date +%s) - t0 ))")")
  printf '%s\n' "${rows[@]}" > "$work/summary.txt" && pack  # what finished survives a cut call
done
printf '%-10s %4s  %-18s %6s\n' stage exit verdict time
tee "$out/summary.txt" < "$work/summary.txt"
pack
