"""Smoke test of a benchmark script (benchmarks are scripts, not timed tests): it runs and its figures are sane."""

import json
import os
import subprocess
import sys

from benchmarks import logprob_passes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_logprob_passes_runs_and_shared_prompts_change_nothing(in_toy_workdir, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["logprob_passes.py", "--prompts", "4", "--num_generations", "4",
                                      "--sizes", "4,16", "--repeat", "1"])
    logprob_passes.main()
    with open(in_toy_workdir / "runs" / "benchmarks" / "logprob_passes.json") as f:
        results = json.load(f)["results"]
    assert [(r["rows"], r["share_prompts"]) for r in results] == [(4, False), (4, True), (16, False), (16, True)]
    assert all(r["ms"] > 0 and r["max_diff"] < 1e-4 for r in results), results


def test_the_gpu_check_rehearses_on_the_cpu_and_refuses_to_run_there(tmp_path):
    """scripts/gpu_check.sh (issue 33): without CUDA it stops with a clear message; GPU_CHECK_REHEARSAL=1 runs it
    through, the GPU tests collected and skipped, and writes the report."""
    script = os.path.join(REPO, "scripts", "gpu_check.sh")
    refused = subprocess.run(["bash", script, str(tmp_path / "r1")], capture_output=True, text=True, cwd=REPO)
    assert refused.returncode == 2 and "error: no CUDA device here" in refused.stderr, refused.stderr
    env = {**os.environ, "GPU_CHECK_REHEARSAL": "1"}
    done = subprocess.run(["bash", script, str(tmp_path / "r2")], capture_output=True, text=True, cwd=REPO, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    report = (tmp_path / "r2" / "report.md").read_text()
    assert "tests/test_gpu.py: exit 0" in report and "skipped" in report and "failed" not in report, report
