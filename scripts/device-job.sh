#!/usr/bin/env bash
# A job longer than one call of a lent GPU machine (each command there is cut at 10 minutes; the machine stays up
# between calls that follow each other closely): start it detached from the call, then wait for it across calls.
#
#   scripts/device-job.sh start NAME 'COMMAND'   copy this tree to /tmp/job-NAME/tree and run COMMAND (bash) there,
#                                                in a session of its own so that it outlives the call; its output
#                                                goes to /tmp/job-NAME/log
#   scripts/device-job.sh wait NAME SECONDS      wait up to SECONDS for it to end, then print the log's tail
#   scripts/device-job.sh stop NAME SECONDS      send TERM to every process of the job (gpu-runbooks.sh then packs
#                                                what finished), wait up to SECONDS for it to end, as `wait` does
#
# The job runs in a copy because every call re-sends the working tree and copies it over the machine's, tracked
# files included: records a job wrote into the tree the call started in are overwritten by the next call's copy.
# Take what a job made from /tmp/job-NAME/tree (e.g. into $OUT) once `wait` says it ended.
#
# Exit (wait, stop): the job's own exit code once it has ended; 124 while it still runs; 2 for bad arguments or an
# unknown job.
set -uo pipefail
usage() { echo "usage: $0 start NAME 'COMMAND' | wait NAME SECONDS | stop NAME SECONDS" >&2; exit 2; }
[ "$#" -eq 3 ] || usage
verb=$1 name=$2
case $name in *[!A-Za-z0-9_-]*|"") echo "job name: letters, digits, '-' and '_' only" >&2; exit 2 ;; esac
dir=/tmp/job-$name
log=$dir/log rc=$dir/rc pidf=$dir/pid
case $verb in
  start)
    [ ! -e "$dir" ] || { echo "job $name was already started (see $log)" >&2; exit 2; }
    mkdir -p "$dir" && cp -a . "$dir/tree" || { echo "could not copy this tree to $dir/tree" >&2; exit 2; }
    cd "$dir/tree" || exit 2
    # setsid: the call's end kills its process group, not a new session (setsid does not fork here: its pid is the
    # session's and the group's, which `stop` signals). rc is written last, once the job is over; the wrapper's
    # TERM handler (a handler, not an ignore: the job's own processes keep TERM's default) lets it outlive `stop`.
    setsid bash -c 'trap : TERM; bash -c "$1"; echo $? > "$2.tmp" && mv "$2.tmp" "$2"' job "$3" "$rc" \
      > "$log" 2>&1 < /dev/null &
    echo $! > "$pidf"
    echo "job $name started in $dir/tree: pid $!, log $log"
    ;;
  wait|stop)
    case $3 in *[!0-9]*|"") usage ;; esac
    [ -e "$log" ] || { echo "no job $name here (nothing at $log)" >&2; exit 2; }
    if [ "$verb" = stop ] && [ ! -e "$rc" ]; then
      kill -TERM -- "-$(cat "$pidf")" 2>/dev/null && echo "job $name: sent TERM to its processes"
    fi
    end=$((SECONDS + $3))
    while [ ! -e "$rc" ] && [ "$SECONDS" -lt "$end" ]; do sleep 2; done
    tail -n 40 "$log"
    if [ -e "$rc" ]; then
      code=$(cat "$rc")
      echo "job $name ended: exit $code"
      exit "$code"
    fi
    echo "job $name still running after ${3}s (log $log)"
    exit 124
    ;;
  *) usage ;;
esac
