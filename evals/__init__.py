"""Benchmark evaluation: avg@k and pass@k on math and multiple-choice benchmarks, from the command line
(`python -m evals.run`) or inside a training loop (`evals.run.load_eval_sets` + `evals.run.evaluate_benchmarks`).
Benchmarks, and how to add one, are in evals/benchmarks.py."""
