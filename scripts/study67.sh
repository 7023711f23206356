#!/bin/bash
# Issue 67's study (docs/study-plan.md), seed by seed: each seed's six arms before the next seed, so that every
# finished seed adds a paired set of all of them. Resumable: run it again and it goes on (evals.compare --resume
# reads finished runs and resumes an interrupted one from its last checkpoint). One thread a run.
# Before each seed, `python -m evals.plan --budget runs` stops the study once another seed would pass the
# 14 CPU-hours planned (the runs' own minutes, one core each).
#
#   nohup setsid bash scripts/study67.sh > runs/study67.log 2>&1 &
#
# CORES=2: two runs at a time on a machine with two free cores, the seeds still in order: a seed's four off-policy
# runs two at a time (evals.compare --jobs 2), then SNIB's and GRPO on-policy's side by side. A run's results do not
# depend on it (one thread, seeded); a seed takes about half the wall time. Run from another checkout (the runs' own,
# at the study's commit), copy this file into that checkout's runs/ and start it there: it works from the folder
# above its own.
set -euo pipefail
cd "$(dirname "$0")/.."
cores=${CORES:-1}
if ! [[ $cores =~ ^[0-9]+$ ]]; then
    echo "error: CORES=$cores: give the number of free cores (1 or 2)" >&2
    exit 2
fi
python -m common.tasks.smollm2 smollm2  # the model and both held-out sets, once
for seed in $(seq 1 "$(python -m evals.plan --seeds)"); do
    if ! python -m evals.plan --budget runs --next "$seed"; then
        break
    fi
    mapfile -t commands < <(python -m evals.plan --commands "$seed")  # off-policy, SNIB, on-policy
    if [ "${#commands[@]}" -ne 3 ]; then
        echo "error: python -m evals.plan --commands $seed gave ${#commands[@]} commands, not 3" >&2
        exit 1
    fi
    if [ "$cores" -lt 2 ]; then
        for command in "${commands[@]}"; do
            echo "$(date -u +%FT%TZ) seed $seed: $command"
            eval "$command" < /dev/null
        done
        continue
    fi
    first=${commands[0]/--jobs 1/--jobs 2}
    echo "$(date -u +%FT%TZ) seed $seed: $first"
    eval "$first" < /dev/null
    pids=()
    for command in "${commands[@]:1}"; do
        echo "$(date -u +%FT%TZ) seed $seed: $command"
        eval "$command" < /dev/null &
        pids+=("$!")
    done
    failed=0  # wait for both, so that no run goes on after the script ends (a rerun would resume it twice)
    for pid in "${pids[@]}"; do
        wait "$pid" || failed=$?
    done
    if [ "$failed" -ne 0 ]; then
        exit "$failed"
    fi
done
echo "$(date -u +%FT%TZ) done"
