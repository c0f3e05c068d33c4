#!/usr/bin/env bash
# The calls of a lent GPU machine for a record longer than one call, where the card that comes decides the work:
# a call for an H200 often gets an H100, and a lease is too short to spend a call finding out.
#
#   scripts/lease.sh first SHA 'H200 CHAIN' ['H100 CHAIN']   the first call: start the chain the card asks for as a
#                                                            detached job (scripts/device-job.sh), then wait for it
#   scripts/lease.sh next                                    each following call (within the machine's idle release):
#                                                            wait for the same job again
#   scripts/lease.sh more 'CHAIN'                            once the job ended, with device time left: run CHAIN as a
#                                                            job of its own in the same tree, so that it finds what
#                                                            the chains before it trained (a dependency recorded
#                                                            there is not trained again); `next` then waits for it
#
# A CHAIN is one GPU's `runbook` commands separated by ';' (scripts/gpu-runbooks.sh), without single quotes, e.g.
# 'record --profile h200' or 'record drift-dial --profile h100.dsv3'. SHA is the full commit id the tree was sent at
# (the records name it; checked before a job starts). Every call ends by packing what the job has recorded so far
# into $OUT/partial.tgz (for `runbook import`, also when the job is still running or the machine is taken back
# next) and copying the job's own output (its logs, results.tgz once it ended) to $OUT. Environment: OUT (required),
# WAIT (seconds a call waits, default 555), JOB (the job's name, default rec), FRESH=1 (install and compile as a
# newly started machine would).
#
# Exit: the job's exit code once it ended; 124 while it still runs; 3 when the card is neither an H200 nor an H100
# with a chain; 2 for bad arguments, or `more` while a job runs or before `first`.
set -uo pipefail
cd "$(dirname "$0")/.."
usage() { echo "usage: $0 first SHA 'H200 CHAIN' ['H100 CHAIN'] | next | more 'CHAIN'  (with OUT set)" >&2; exit 2; }
[ -n "${OUT:-}" ] || { echo "set OUT to the folder whose files come back from the call" >&2; exit 2; }
name=${JOB:-rec} wait_s=${WAIT:-555}
dir=/tmp/job-$name

# The job a call waits for: NAME's first chain, or the last one `more` started (NAME-2, NAME-3, ...). Every chain
# runs in the first one's tree (/tmp/job-NAME/tree): its records and trained outputs accumulate there.
state=/tmp/job-$name.lease  # lines: the commit id, then the current job's name
current() { sed -n 2p "$state" 2>/dev/null; }

# What the chains recorded so far, and the current job's output, into $OUT; then its state as this script's exit code.
collect() {
  local rc=$1
  if [ -d "$dir/tree" ]; then
    (cd "$dir/tree" && tar czf "$OUT/partial.tgz" baselines docs/runbooks/executed logs 2>/dev/null)
    cp -a "/tmp/job-$(current)/out/." "$OUT/" 2>/dev/null
  fi
  exit "$rc"
}

check_chain() {
  case $1 in *"'"*) echo "a chain holds no single quotes: $1" >&2; exit 2 ;; esac
}

case ${1:-} in
  first)
    [ "$#" -ge 3 ] && [ "$#" -le 4 ] || usage
    sha=$2
    [[ $sha =~ ^[0-9a-f]{40}$ ]] || { echo "SHA: the full 40-digit commit id the records will name, not '$sha'" >&2; exit 2; }
    card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
    case $card in
      *H200*) chain=$3 ;;
      *H100*) chain=${4:-} ;;
      *) chain= ;;
    esac
    [ -n "$chain" ] || { echo "no chain for this card (${card:-no GPU found})" >&2; exit 3; }
    check_chain "$chain"
    echo "card: $card; chain: $chain"
    scripts/device-job.sh start "$name" "export SPECBOOK_GIT_COMMIT=$sha; mkdir -p $dir/out; \
FRESH=${FRESH:-0} OUT=$dir/out scripts/gpu-runbooks.sh '$chain'" || exit $?
    printf '%s\n%s\n' "$sha" "$name" > "$state"
    scripts/device-job.sh wait "$name" "$wait_s"
    collect $?
    ;;
  next)
    [ "$#" -eq 1 ] || usage
    [ -n "$(current)" ] || { echo "no lease job here: start one with $0 first" >&2; exit 2; }
    scripts/device-job.sh wait "$(current)" "$wait_s"
    collect $?
    ;;
  more)
    [ "$#" -eq 2 ] || usage
    check_chain "$2"
    job=$(current)
    [ -n "$job" ] || { echo "no lease job here: start one with $0 first" >&2; exit 2; }
    [ -e "/tmp/job-$job/rc" ] || { echo "job $job still runs: wait for it with $0 next" >&2; exit 2; }
    n=2
    while [ -e "/tmp/job-$name-$n" ]; do n=$((n + 1)); done
    new=$name-$n
    # device-job.sh copies the directory it starts in: an empty one, since the chain runs in the first one's tree
    here=$PWD
    mkdir -p "/tmp/job-$name.empty" && cd "/tmp/job-$name.empty" || exit 2
    "$here/scripts/device-job.sh" start "$new" "export SPECBOOK_GIT_COMMIT=$(sed -n 1p "$state"); \
mkdir -p /tmp/job-$new/out; cd $dir/tree && FRESH=0 OUT=/tmp/job-$new/out scripts/gpu-runbooks.sh '$2'" || exit $?
    cd "$here" || exit 2
    printf '%s\n%s\n' "$(sed -n 1p "$state")" "$new" > "$state"
    scripts/device-job.sh wait "$new" "$wait_s"
    collect $?
    ;;
  *) usage ;;
esac
