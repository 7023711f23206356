"""Benchmark evaluation: avg@k and pass@k on math and multiple-choice benchmarks, from the command line
(`python -m evals.run`) or inside a training loop (`common.tasks.benchmark_scoring.load_eval_sets` +
`evaluate_benchmarks`). Benchmarks, and how to add one, are in common/tasks/benchmark_sets.py; the evaluation itself
is common/tasks/benchmark_scoring.py.

`ALGORITHMS`: the estimator scripts, found at the project root, so that a new estimator is one new file (plus its
tests and docs page) for evals.compare, the step-time benchmark and the tests that run every script."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def discover_algorithms(root: str = ROOT) -> tuple[str, ...]:
    """The top-level scripts that define `compute_loss` (grpo.py first: every other script is diffed against it)."""
    names = []
    for name in os.listdir(root):
        if name.endswith(".py"):
            with open(os.path.join(root, name)) as f:
                if "\ndef compute_loss(" in f.read():
                    names.append(name.removesuffix(".py"))
    return tuple(sorted(names, key=lambda n: (n != "grpo", n)))


ALGORITHMS = discover_algorithms()
