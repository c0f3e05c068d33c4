#!/usr/bin/env bash
# Run runbooks on a lent GPU machine that has no network: one chain of `runbook` commands per GPU, in parallel.
#
#   scripts/gpu-runbooks.sh "run --record train-target;run --record baseline-eagle3" "verify --profile h200 baseline-decode"
#
# Each argument is one GPU's chain: `runbook` commands separated by ';', run in order on that GPU
# (CUDA_VISIBLE_DEVICES). With SHARE_GPU=1 every chain runs on GPU 0, side by side: for chains whose numbers are all
# exact (the training runbooks), never for timings. Before them it installs the wheels carried in .whl/ (papermill, jupytext, ipykernel...:
# scripts/device-wheels.sh makes them) and points the training corpus at the archives carried in
# corpus-archives/ (`python -m engine train corpus --fetch` with SPECBOOK_CORPUS_DIR there). Set SPECBOOK_GIT_COMMIT
# to the commit the tree was sent at: the copy has no .git, and the records name it. Everything a run wrote that a
# commit needs (baselines/, docs/runbooks/executed/) and one log per GPU are packed into $OUT/results.tgz, also
# when the script is cut (TERM: what finished is packed, exit 124); the logs are in $OUT as they are written. It ends
# with a table of where the time went: each runbook's start, end and wall time, its runs' kernel start and cells.
# With FRESH=1 it first removes what earlier runs on this machine left behind - the installed wheels and the torch,
# inductor and Triton compile caches - so that the run installs and compiles everything as a newly started machine
# would (a verify timed in the lease that recorded).
# Exit: 0 when every command succeeded, else the first failing command's code (each chain still runs to its end).
set -uo pipefail
cd "$(dirname "$0")/.."
[ "$#" -ge 1 ] || { echo "usage: $0 'CMD;CMD' ['CMD;CMD' ...]  (one chain per GPU)" >&2; exit 2; }
[ -n "${SPECBOOK_GIT_COMMIT:-}" ] || { echo "set SPECBOOK_GIT_COMMIT to the commit this tree was sent at" >&2; exit 2; }
# A .git that came along is the sending checkout's as it was when its session began: it need not know a commit made
# since. Then git is not asked (specbook checks the sent commit's form alone, as on a copy without .git).
if [ -e .git ] && ! git cat-file -e "$SPECBOOK_GIT_COMMIT^{commit}" 2>/dev/null; then
  echo "the .git that came along does not know $SPECBOOK_GIT_COMMIT (an older copy): recorded without asking it"
  export GIT_DIR=/nonexistent/.git
fi
out=${OUT:-/tmp/gpu-runbooks}
mkdir -p "$out" logs && rm -f logs/gpu*.rc
tmp=${TMPDIR:-/tmp}
site=$tmp/site

if [ "${FRESH:-0}" = 1 ]; then
  rm -rf "$site" "$tmp"/torchinductor_* "$HOME/.triton" "$HOME/.cache/torch" "$HOME/.cache/triton"
  echo "FRESH=1: removed the installed wheels ($site) and the compile caches"
fi

. scripts/carried-wheels.sh
carried_wheels "$site"
export SPECBOOK_CORPUS_DIR=$PWD/corpus-archives PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader

# What a commit needs, packed at the end, or when the run is cut (timeout's TERM): what the finished runs recorded
pack() { tar czf "$out/results.tgz" baselines docs/runbooks/executed logs 2>/dev/null; }

# Where the time went, one row per runbook, from the log lines of specbook: the scheduler's `[GPU] KEY: started`
# and `KEY: finished in S s (exit N)`, and each run's `done KEY in S s (kernel start K s, cells C s)` (a verify that
# confirms a number runs a runbook more than once). A runbook still running when the run was cut has no end.
summary() {
  awk '
    function note(k) { if (!(k in seen)) { seen[k] = 1; keys[++n] = k } }
    $1 ~ /^[0-9][0-9]:[0-9][0-9]:[0-9][0-9]$/ { if (first == "" || $1 < first) first = $1; if ($1 > last) last = $1 }
    {
      for (i = 3; i < NF; i++) {
        if ($i == "done" && $(i + 2) == "in" && $(i + 4) == "s") {
          k = $(i + 1); note(k); runs[k]++; secs[k] += $(i + 3); ended[k] = $1
          if ($(i + 5) == "(kernel") { kern[k] += $(i + 7); cells[k] += $(i + 10) }
          break
        }
        if ($i ~ /[/].*:$/ && ($(i + 1) == "started" || $(i + 1) == "finished")) {
          k = substr($i, 1, length($i) - 1); note(k)
          if ($(i + 1) == "started") start[k] = $1
          else { wall[k] = $(i + 3); code[k] = $(i + 6); sub(/[)]$/, "", code[k]); ended[k] = $1 }
          break
        }
      }
    }
    END {
      if (!n) exit
      f = "%-28s %8s %8s %7s %5s %7s %7s %5s\n"
      printf f, "runbook", "started", "ended", "wall s", "runs", "kernel", "cells", "exit"
      for (j = 1; j <= n; j++) {
        k = keys[j]
        printf f, k, (k in start) ? start[k] : "-", (k in ended) ? ended[k] : "running", \
          (k in wall) ? wall[k] : ((k in secs) ? secs[k] : "-"), runs[k] + 0, (k in kern) ? kern[k] : "-", \
          (k in cells) ? cells[k] : "-", (k in code) ? code[k] : "-"
      }
      printf "log from %s to %s (UTC)\n", first, last
    }' "$@"
}
table() { echo "== where the time went"; summary logs/gpu*.log | tee logs/summary.txt; }
trap 'echo "== cut at $(date -u +%H:%M:%S): packing what finished" >&2; table; pack; exit 124' TERM INT

# each line of a chain's log gets the time (UTC) and its GPU: where a run's minutes went, read off the log
stamp() { while IFS= read -r line; do TZ=UTC printf '%(%H:%M:%S)T [gpu %s] %s\n' -1 "$1" "$line"; done; }

gpu=0
for chain in "$@"; do
  (
    export CUDA_VISIBLE_DEVICES=$([ "${SHARE_GPU:-0}" = 1 ] && echo 0 || echo "$gpu")
    rc=0
    IFS=';' read -ra cmds <<< "$chain"
    for cmd in "${cmds[@]}"; do
      echo "== gpu $gpu: runbook $cmd ($(date -u +%H:%M:%S))"
      # shellcheck disable=SC2086 - a command is words
      python3 -m specbook.cli $cmd || { c=$?; echo "== gpu $gpu: exit $c: runbook $cmd"; [ "$rc" -ne 0 ] || rc=$c; }
    done
    echo "$rc" > "logs/gpu$gpu.rc"
  ) 2>&1 | stamp "$gpu" | tee "logs/gpu$gpu.log" > "$out/gpu$gpu.log" &
  gpu=$((gpu + 1))
done

# each chain's log is written to $out as it runs: a lent machine's call that is cut still returns it
wait
tail -q -n 40 logs/gpu*.log
table
rc=0
for ((g = 0; g < gpu; g++)); do
  c=$(cat "logs/gpu$g.rc" 2>/dev/null || echo 3)
  [ "$rc" -ne 0 ] || rc=$c
done
pack
exit "$rc"
