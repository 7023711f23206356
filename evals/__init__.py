"""Benchmark evaluation: avg@k and pass@k on math and multiple-choice benchmarks, from the command line
(`python -m evals.run`) or inside a training loop (`common.evaluation.load_eval_sets` + `evaluate_benchmarks`).
Benchmarks, and how to add one, are in common/benchmarks.py; the evaluation itself is common/evaluation.py."""
