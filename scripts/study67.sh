#!/bin/bash
# Issue 67's study (docs/study-plan.md), seed by seed: each seed's six arms before the next seed, so that every
# finished seed adds a paired set of all of them. Resumable: run it again and it goes on (evals.compare --resume
# reads finished runs and resumes an interrupted one from its last checkpoint). One run at a time, one thread.
# Before each seed, `python -m evals.plan --budget runs` stops the study once another seed would pass the
# 14 CPU-hours planned (the runs' own minutes, one core each).
#
#   nohup setsid bash scripts/study67.sh > runs/study67.log 2>&1 &
set -euo pipefail
cd "$(dirname "$0")/.."
python -m common.tasks.smollm2 smollm2  # the model and both held-out sets, once
for seed in $(seq 1 "$(python -m evals.plan --seeds)"); do
    if ! python -m evals.plan --budget runs --next "$seed"; then
        break
    fi
    python -m evals.plan --commands "$seed" | while read -r command; do
        echo "$(date -u +%FT%TZ) seed $seed: $command"
        eval "$command" < /dev/null
    done
done
echo "$(date -u +%FT%TZ) done"
