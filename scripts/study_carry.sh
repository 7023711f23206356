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
# in (the tests'). An interrupted run is not carried: it starts anew.
set -euo pipefail
if [ $# -lt 3 ] || [ $# -gt 4 ] || { [ "$1" != save ] && [ "$1" != restore ]; }; then
    echo "usage: bash scripts/study_carry.sh save|restore TAG RUNS_FOLDER [CARRIED_FOLDER]" >&2
    exit 2
fi
action=$1
tag=$2
study="$3/compare-$tag"
carried=${4:-"$(cd "$(dirname "$0")/.." && pwd)/docs/studies/unfinished/$tag"}
if [ "$action" = save ]; then
    mkdir -p "$carried"
    count=0
    for result in "$study"/*.result.json; do
        [ -e "$result" ] || continue
        run=$(basename "$result" .result.json)
        cp "$result" "$carried/"
        mkdir -p "$carried/$run"
        cp "$study/$run/metrics.jsonl" "$carried/$run/"
        count=$((count + 1))
    done
    echo "saved $count finished runs of $study in $carried"
else
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
