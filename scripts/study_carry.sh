#!/bin/bash
# Carry the finished runs of an unfinished evals.compare study from one machine to the next.
#
# A study of real-model runs outlasts a session, and a session's machine may not outlast it. A finished run is its
# <run>.result.json (read by `evals.compare --resume` instead of running it again) and its metrics.jsonl; both are
# small, so they travel in the repository, under docs/studies/unfinished/TAG/, until the study is published.
#
#   bash scripts/study_carry.sh save TAG RUNS      # RUNS/compare-TAG's finished runs -> docs/studies/unfinished/TAG/
#   bash scripts/study_carry.sh restore TAG RUNS   # and back, before `python -m evals.compare ... --tag TAG --resume`
#
# RUNS is the runs/ folder of the checkout the study runs from; a fourth argument names another folder to carry them
# in (the tests'). An interrupted run is not carried: it starts anew. A run's floats depend on the machine and the
# code, so a run whose result does not name its machine or commit (one of a checkout older than evals.compare's
# machine()) is stamped with this machine and with the commit of the checkout RUNS lies in when saved: save on the
# machine that ran it, in the session it finished, from the checkout (or worktree) that ran it.
set -euo pipefail
if [ $# -lt 3 ] || [ $# -gt 4 ] || { [ "$1" != save ] && [ "$1" != restore ]; }; then
    echo "usage: bash scripts/study_carry.sh save|restore TAG RUNS_FOLDER [CARRIED_FOLDER]" >&2
    exit 2
fi
action=$1
tag=$2
study="$3/compare-$tag"
repo=$(cd "$(dirname "$0")/.." && pwd)
carried=${4:-"$repo/docs/studies/unfinished/$tag"}
if [ "$action" = save ]; then
    if [ ! -d "$study" ]; then
        echo "error: no study folder $study (RUNS is the runs/ folder the study ran in)" >&2
        exit 1
    fi
    mkdir -p "$carried"
    study=$(cd "$study" && pwd)  # absolute: the stamp below runs in the repository's root
    carried=$(cd "$carried" && pwd)
    commit=$(git -C "$study" rev-parse HEAD 2>/dev/null || true)  # the checkout the runs ran in (none: not stamped)
    count=0
    for result in "$study"/*.result.json; do
        [ -e "$result" ] || continue
        run=$(basename "$result" .result.json)
        if [ ! -f "$study/$run/metrics.jsonl" ]; then
            echo "error: $result has no $study/$run/metrics.jsonl; nothing of it carried" >&2
            exit 1
        fi
        mkdir -p "$carried/$run"
        cp "$study/$run/metrics.jsonl" "$carried/$run/"
        # the result last, stamped with this machine where it names none: a carried result is a finished run
        (cd "$repo" && ${PYTHON:-python} -c 'import json, sys
from evals.compare import machine
with open(sys.argv[1]) as f:
    result = json.load(f)
result.setdefault("machine", machine())
if sys.argv[3]:
    result.setdefault("commit", sys.argv[3])
with open(sys.argv[2], "w") as f:
    json.dump(result, f)' "$result" "$carried/$run.result.json" "$commit")
        count=$((count + 1))
    done
    echo "saved $count finished runs of $study in $carried"
else
    if [ ! -d "$carried" ]; then
        echo "error: nothing carried for $tag ($carried does not exist)" >&2
        exit 1
    fi
    mkdir -p "$study"
    count=0
    for result in "$carried"/*.result.json; do
        [ -e "$result" ] || continue
        run=$(basename "$result" .result.json)
        mkdir -p "$study/$run"
        cp "$carried/$run/metrics.jsonl" "$study/$run/"
        cp "$result" "$study/"  # last: a run with a result file is finished
        count=$((count + 1))
    done
    echo "restored $count finished runs of $carried in $study"
fi
