"""Smoke test of a benchmark script (benchmarks are scripts, not timed tests): it runs and its figures are sane."""

import json
import sys

from benchmarks import logprob_passes


def test_logprob_passes_runs_and_shared_prompts_change_nothing(in_toy_workdir, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["logprob_passes.py", "--prompts", "4", "--num_generations", "4",
                                      "--sizes", "4,16", "--repeat", "1"])
    logprob_passes.main()
    with open(in_toy_workdir / "runs" / "benchmarks" / "logprob_passes.json") as f:
        results = json.load(f)["results"]
    assert [(r["rows"], r["share_prompts"]) for r in results] == [(4, False), (4, True), (16, False), (16, True)]
    assert all(r["ms"] > 0 and r["max_diff"] < 1e-4 for r in results), results
