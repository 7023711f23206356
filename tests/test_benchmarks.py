"""Smoke test of a benchmark script (benchmarks are scripts, not timed tests): it runs and its figures are sane."""

import ast
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import subprocess_env

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


def test_shared_prompt_grad_computes_what_the_update_computes(toy_workdir):
    """benchmarks/shared_prompt_grad.py on the toy: the prompts' forward shared with gradients gives the plain
    update's log-probs and gradients (float32 sums in another order)."""
    from benchmarks import shared_prompt_grad

    results = shared_prompt_grad.main(["--model", str(toy_workdir / "runs" / "toy" / "model"), "--rows", "4",
                                       "--prompt", "6", "--completion", "5", "--distinct", "1,2", "--repeat", "1"])
    assert [r["distinct"] for r in results] == [1, 2], results
    assert all(r["logp_max_diff"] < 1e-4 and r["grad_rel_diff"] < 1e-4 for r in results), results
    assert all(r["plain_s"] > 0 and r["shared_s"] > 0 for r in results), results


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
    assert "benchmarks/update_mfu.py (rehearsal, tiny on the CPU): exit 0" in report, report


def test_every_update_the_gpu_check_times_runs_small_on_the_cpu():
    """Each update_mfu.py invocation in scripts/gpu_check.sh's lists, its size and geometry made tiny and its flags
    kept, runs on the CPU: a flag the benchmark does not take, or a combination it refuses, fails here and not in a
    lease's minutes."""
    from benchmarks import update_mfu

    text = open(os.path.join(REPO, "scripts", "gpu_check.sh")).read()
    specs = re.findall(r'"((?:0\.6b|1\.7b|4b) \d+ \d+ \d+[^"]*)"', text)
    assert len(specs) >= 12 and any("--gradient_checkpointing_every" in s for s in specs), specs
    assert any("--nograd" in s for s in specs), specs
    tiny = ["--size", "tiny", "--tokens", "48", "--prompt_tokens", "16", "--rows", "2", "--device", "cpu",
            "--steps", "1", "--warmup", "0", "--vocab", "512", "--dtype", "float32"]
    for spec in set(specs):
        size, lora_r, tokens, rows, *flags = spec.split()
        result = update_mfu.main(tiny + ["--lora_r", lora_r, *flags])
        assert result["tokens_per_s"] > 0, spec
        assert result["gradient_checkpointing"] == ("--gradient_checkpointing" in flags), spec


@pytest.mark.parametrize("mode, runs", [("1", 6), ("chunk", 5), ("4b", 5), ("nograd", 2)])
def test_the_gpu_checks_update_parts_each_write_a_file_of_their_own(tmp_path, mode, runs):
    """scripts/gpu_check.sh's update part as a lease runs it (GPU_CHECK_UPDATE=1, chunk or 4b; tests and steps left
    out), with a stand-in python3 on PATH that says CUDA is there and records each call: every update_mfu.py run
    is called, and each writes its own --out file (two runs writing one file lost a figure once)."""
    stub = tmp_path / "bin"
    stub.mkdir()
    log = tmp_path / "calls.log"
    (stub / "python3").write_text(f"""#!/usr/bin/env bash
echo "$*" >> {log}
case "$*" in
    *"import trl"*|*"import vllm"*) exit 1 ;;
    *update_mfu.py*) echo "Qwen3-stand-in" ;;
esac
exit 0
""")
    (stub / "python3").chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "GPU_CHECK_TESTS": "0", "GPU_CHECK_STEPS": "0",
           "GPU_CHECK_UPDATE": mode}
    done = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), str(tmp_path / "report")],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = [line.split() for line in log.read_text().splitlines() if "benchmarks/update_mfu.py" in line]
    outs = [call[call.index("--out") + 1] for call in calls]
    assert len(calls) == runs and len(set(outs)) == runs, outs
    assert all(out.startswith(str(tmp_path / "report")) and out.endswith(".json") for out in outs), outs
    report = (tmp_path / "report" / "report.md").read_text()
    assert report.count("update_mfu.py --size") == runs and ": exit 0" in report, report


# Every script in benchmarks/ has a smoke test: it runs on the smallest work it accepts and its figures are sane.
# logprob_passes and the GPU check are above; copy_cost.py in tests/test_siblings.py; weight_push.py (needs vLLM) in
# tests/test_vllm_engine.py. tests/test_benchmarks.py::test_every_benchmark_script_has_a_smoke_test holds the list.


def run_benchmark(args: list[str], cwd, timeout: int = 600) -> subprocess.CompletedProcess:
    env = subprocess_env()  # the repository first on PYTHONPATH, the caller's after it; one thread
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
@pytest.mark.peer
def test_step_time_runs_a_script_and_trl_on_the_same_work(toy_workdir, tmp_path):
    """benchmarks/step_time.py --trl: 3 tiny steps of grpo.py and of TRL's GRPOTrainer, each in its own process, on
    the toy; every figure present and positive. (It broke once at its first step, unnoticed: no test ran it.)"""
    out = tmp_path / "step_time.json"
    run_benchmark([os.path.join(REPO, "benchmarks", "step_time.py"), "--algo", "grpo", "--steps", "3", "--trl",
                   "--output_dir", str(tmp_path / "runs"), "--out", str(out), "--", "--batch_size", "8",
                   "--num_generations", "4", "--micro_batch_size", "4"], cwd=toy_workdir)
    report = json.loads(out.read_text())
    assert set(report["runs"]) == {"grpo", "trl"}
    for name, run in report["runs"].items():
        s = run["summary"]
        assert s["time/step"] > 0 and s["time/tokens_per_s"] > 0 and s["memory/peak_gib"] > 0, (name, s)
        assert s["time/update"] > 0 and s["time/rollout"] > 0, (name, s)
    assert report["ratios"]["grpo/trl time/step"] > 0 and report["ratios"]["grpo/trl cpu/step"] > 0


@pytest.mark.slow
@pytest.mark.peer
def test_trl_curve_evaluates_trl_as_grpo_py_does(toy_workdir, tmp_path):
    """benchmarks/trl_curve.py: 2 tiny TRL steps on the toy, held-out accuracy at steps 0, 1 and 2; step 0 equals
    grpo.py's own step-0 eval/accuracy on the same work (the same model and greedy decoding of the same prompts);
    benchmarks/trl_curve_plot.py draws the two."""
    flags = ["--total_steps", "2", "--eval_steps", "1", "--batch_size", "8", "--num_generations", "4",
             "--micro_batch_size", "4"]
    out = tmp_path / "curve.json"
    run_benchmark([os.path.join(REPO, "benchmarks", "trl_curve.py"), "--preset", "toy", "--out", str(out), "--",
                   *flags, "--output_dir", str(tmp_path / "runs")], cwd=toy_workdir)
    curve = json.loads(out.read_text())["curve"]
    assert [c["step"] for c in curve] == [0, 1, 2] and all(0 <= c["accuracy"] <= 1 for c in curve), curve
    assert curve[0]["wall_s"] == 0 and curve[2]["wall_s"] > 0 and curve[2]["cpu_s"] > 0, curve
    run_benchmark([os.path.join(REPO, "grpo.py"), "--preset", "toy", *flags, "--output_dir", str(tmp_path / "runs"),
                   "--run_name", "grpo_curve"], cwd=toy_workdir)
    with open(tmp_path / "runs" / "grpo_curve" / "metrics.jsonl") as f:
        grpo_step0 = next(m for m in map(json.loads, f) if "eval/accuracy" in m)
    assert grpo_step0["step"] == 0 and grpo_step0["eval/accuracy"] == pytest.approx(curve[0]["accuracy"]), grpo_step0
    training = json.loads(out.read_text())["training"]  # TRL's own logs, a line per step
    assert [t["step"] for t in training] == [1, 2] and all(0 <= t["reward"] <= 1 for t in training), training
    # benchmarks/trl_curve_plot.py on these two: the means it prints are the curves' (one seed each: std 0)
    figure = tmp_path / "curve.png"
    proc = run_benchmark([os.path.join(REPO, "benchmarks", "trl_curve_plot.py"), "--grpo",
                          str(tmp_path / "runs" / "grpo_curve"), "--trl", str(out), "--out", str(figure)], cwd=tmp_path)
    assert f"TRL GRPOTrainer: step 0 {100 * curve[0]['accuracy']:.1f} +- 0.0%" in proc.stdout, proc.stdout
    assert f"grpo.py: step 0 {100 * grpo_step0['eval/accuracy']:.1f} +- 0.0%" in proc.stdout, proc.stdout
    assert figure.stat().st_size > 10_000, figure.stat()


def test_grader_agreement_reads_the_gsm8k_files(tmp_path):
    """benchmarks/grader_agreement.py on a two-problem copy of the files it reads: the agreement lines, and a wrong
    label written out as a disagreement."""
    from benchmarks.grader_agreement import MODELS

    solutions = [{"question": "2 + 3?", "ground_truth": "2 + 3 = 5\nA: 5",
                  **{m: {"solution": "2 + 3 = 5\nA: 5", "is_correct": m != MODELS[0]} for m in MODELS}}]
    (tmp_path / "example_model_solutions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in solutions))
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text(json.dumps({"question": "4 + 4?", "answer": "4 + 4 = 8\n#### 8"}))
    out = tmp_path / "disagreements.jsonl"
    proc = run_benchmark([os.path.join(REPO, "benchmarks", "grader_agreement.py"), "--gsm8k", str(tmp_path),
                          "--out", str(out)], cwd=tmp_path)
    assert f"model_solutions/{MODELS[0]}: 0/1 = 0.00% agree" in proc.stdout, proc.stdout
    assert f"model_solutions/{MODELS[1]}: 1/1 = 100.00% agree" in proc.stdout and "references/test: 1/1" in proc.stdout
    assert len(out.read_text().splitlines()) == 1


def test_grader_worst_case_runs_small(tmp_path):
    proc = run_benchmark([os.path.join(REPO, "benchmarks", "grader_worst_case.py"), "--small", "20",
                          "--end_to_end_bytes", "2000", "--cap", "5"], cwd=tmp_path)
    assert re.search(r"^\d+ cases in \d+ s; 0 superlinear or raising", proc.stdout, re.M), proc.stdout
    assert "completions of 2,000 bytes" in proc.stdout


def test_logprobs_memory_runs_small(tmp_path):
    out = tmp_path / "m.json"
    run_benchmark([os.path.join(REPO, "benchmarks", "logprobs_memory.py"), "--vocab", "512", "--batch", "1",
                   "--length", "8", "--dtypes", "float32", "--out", str(out)], cwd=tmp_path)
    results = json.loads(out.read_text())["results"]
    assert len(results) == 8 and not [r for r in results if "error" in r], results
    logp_sum = {(r["variant"], r["mode"]): r["logp_sum"] for r in results}
    assert logp_sum[("lean_logp", "nograd")] == logp_sum[("lean", "nograd")]  # the same log-probs without the entropy


@pytest.mark.slow
def test_qwen3_shape_builds_its_task(tmp_path, monkeypatch):
    from benchmarks import qwen3_shape

    path = qwen3_shape.prepare(str(tmp_path / "shape"))
    assert os.path.exists(os.path.join(path, "model", "config.json"))
    assert json.load(open(os.path.join(path, "model", "config.json")))["vocab_size"] == qwen3_shape.QWEN3_VOCAB


def test_update_mfu_runs_small_full_and_lora(tmp_path, monkeypatch):
    """benchmarks/update_mfu.py on a tiny Qwen3 on the CPU (its GPU figures come from scripts/gpu_check.sh): one
    update step each way, with the parameters its MFU counts: all of them for a tied head (the embedding's matrix is
    the head's), the base model's too under LoRA."""
    from benchmarks import update_mfu

    small = ["--size", "tiny", "--tokens", "48", "--prompt_tokens", "16", "--rows", "2", "--device", "cpu",
             "--steps", "1", "--vocab", "512", "--dtype", "float32"]
    full = update_mfu.main(small + ["--out", str(tmp_path / "full.json")])
    lora = update_mfu.main(small + ["--lora_r", "4"])
    assert full["tokens_per_s"] > 0 and full["mfu"] is None and full["peak_memory_gib"] is None
    assert json.loads((tmp_path / "full.json").read_text())["path_parameters"] == full["path_parameters"]
    assert full["trainable_parameters"] == full["path_parameters"]  # tied: every parameter is on the path
    assert lora["path_parameters"] == full["path_parameters"] + lora["trainable_parameters"]
    assert 0 < lora["trainable_parameters"] < full["trainable_parameters"] / 4
    import common.logprobs

    default = common.logprobs.LOGPROB_CHUNK_ELEMENTS
    chunks, plain = [], common.logprobs._chunks  # the number of chunks of each pass of the head

    def counted(N, V):
        slices = list(plain(N, V))
        chunks.append(len(slices))
        return iter(slices)

    monkeypatch.setattr(common.logprobs, "_chunks", counted)

    small_chunks = update_mfu.main(small + ["--chunk_elements", str(4 * 512)])  # 4 positions a chunk at V = 512
    assert small_chunks["chunk_elements"] == 4 * 512 and full["chunk_elements"] == default
    assert set(chunks) == {2 * 32 // 4}, chunks  # 2 rows x 32 completion positions, 4 a chunk, every pass
    assert common.logprobs.LOGPROB_CHUNK_ELEMENTS == default  # restored for the rest of the process


@pytest.mark.peer
@pytest.mark.parametrize("flags, said", [
    (["--lora_r", "4"], "--trl compares one optimizer step per RL step"),
    (["--num_iterations", "2"], "--trl compares one optimizer step per RL step"),
    (["--gradient_checkpointing", "--gradient_checkpointing_every", "2"], "TRL recomputes every layer"),
])
def test_step_time_refuses_a_trl_comparison_of_unequal_work_before_building_anything(tmp_path, monkeypatch, flags,
                                                                                     said):
    """TRL cannot do these as grpo.py would (several optimizer steps a batch, LoRA's reference, one layer in K
    recomputed): refused with the fix, before the preset's model is built (in an empty folder, nothing is)."""
    from benchmarks import step_time

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=said):
        step_time.trl_config_and_data(["--preset", "toy", *flags], 1)
    assert not os.path.exists(tmp_path / "runs")


def test_update_mfu_times_the_scripts_attention_and_checkpointing(tmp_path, monkeypatch):
    """update_mfu.py times what the scripts run: cuDNN's attention off (unless --cudnn_sdp), and gradient
    checkpointing through the scripts' own common.run.checkpoint_layers, with --gradient_checkpointing_every."""
    import torch

    import common.run
    from benchmarks import update_mfu

    small = ["--size", "tiny", "--tokens", "48", "--prompt_tokens", "16", "--rows", "2", "--device", "cpu",
             "--steps", "1", "--vocab", "512", "--dtype", "float32"]
    calls, plain = [], common.run.checkpoint_layers

    def recorded(model, every=1):
        calls.append(every)
        plain(model, every)

    monkeypatch.setattr(common.run, "checkpoint_layers", recorded)
    torch.backends.cuda.enable_cudnn_sdp(True)  # a new process's default
    half = update_mfu.main(small + ["--gradient_checkpointing", "--gradient_checkpointing_every", "2"])
    assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert calls == [2] and half["gradient_checkpointing_every"] == 2 and half["cudnn_sdp"] is False
    on = update_mfu.main(small + ["--cudnn_sdp", "--profile"])
    assert on["gpu_idle_fraction"] is None and "aten::" in on["profile_top_ops"]  # the CPU's ops, without CUDA
    assert half["profile_top_ops"] == ""  # no --profile: no table
    assert torch.backends.cuda.cudnn_sdp_enabled() and on["cudnn_sdp"] is True
    assert calls == [2] and on["gradient_checkpointing_every"] == 0  # no checkpointing asked: none
    ours = update_mfu.main(small + ["--nograd", "scripts"])
    theirs = update_mfu.main(small + ["--nograd", "logits"])
    assert ours["nograd"] == "scripts" and theirs["nograd"] == "logits" and ours["logp_sum"] < 0
    assert ours["logp_sum"] == pytest.approx(theirs["logp_sum"], rel=1e-5)  # the same log-probs, two ways
    assert half["nograd"] == "" and half["logp_sum"] is None
    with pytest.raises(SystemExit, match="--gradient_checkpointing_every 0 must be at least 1"):
        update_mfu.main(small + ["--gradient_checkpointing", "--gradient_checkpointing_every", "0"])


def test_learning_bars_runs_and_resumes(toy_workdir, tmp_path, monkeypatch):
    """benchmarks/learning_bars.py on one estimator and seed, 2 steps: the gain it reports is the run's last
    held-out accuracy less its first; a second call reads the finished run instead of running it again."""
    from benchmarks import learning_bars

    monkeypatch.chdir(tmp_path)
    argv = ["--toys", str(toy_workdir / "runs" / "toy"), "--algos", "grpo", "--seeds", "1", "--jobs", "1",
            "--extra", "--total_steps 2 --eval_steps 2 --eval_num_prompts 8", "--evaluations", "2",
            "--out", "summary.json"]
    first = learning_bars.main(argv)
    metrics = tmp_path / "runs" / "learning_bars" / "toy" / "runs" / "grpo__s1" / "metrics.jsonl"
    accuracies = [m["eval/accuracy"] for m in map(json.loads, metrics.read_text().splitlines()) if "eval/accuracy" in m]
    assert first["grpo"]["all"]["gains"] == [accuracies[-1] - accuracies[0]] and len(accuracies) == 2
    stamp = metrics.stat().st_mtime_ns
    assert learning_bars.main(argv) == first and metrics.stat().st_mtime_ns == stamp  # read, not run again


def test_learning_bars_merge_keeps_the_other_estimators_runs(tmp_path, monkeypatch):
    """--merge (a new estimator's runs added to the published file): the runs of the estimators run now replace
    theirs, the others' stay, the summary is of the merged runs and both commands are kept."""
    from benchmarks import learning_bars

    def fake_run(toy, name, script, flags, seed, extra, expected):
        return {"name": name, "toy": "seed0", "toy_sha256": "abc", "seed": seed, "gain": 0.5 + seed / 10}

    monkeypatch.setattr(learning_bars, "run_one", fake_run)
    out = tmp_path / "bars.json"
    old = [{"name": n, "toy": "seed0", "toy_sha256": "abc", "seed": 1, "gain": g} for n, g in [("grpo", 0.1),
                                                                                              ("gspo", 0.2)]]
    out.write_text(json.dumps({"command": "python benchmarks/learning_bars.py --first", "runs": old, "summary": {}}))
    summary = learning_bars.main(["--algos", "gspo", "--toys", "t", "--seeds", "2", "--out", str(out), "--merge"])
    written = json.loads(out.read_text())
    assert [(r["name"], r["gain"]) for r in written["runs"]] == [("grpo", 0.1), ("gspo", 0.6), ("gspo", 0.7)]
    assert summary["grpo"]["all"]["gains"] == [0.1] and summary["gspo"]["all"]["gains"] == [0.6, 0.7]
    assert written["commands"][0] == "python benchmarks/learning_bars.py --first" and len(written["commands"]) == 2


def test_the_learning_bars_are_the_studys_figures(tmp_path):
    """tests/data/learning_bars.json, whose runs the learning tests take their bars from (conftest.learning_bar),
    is what benchmarks/learning_bars.py wrote: 3 seeds of every estimator on each of CI's two toys, its summary the
    runs' own means and stds. A bar is strong on a toy measured (this test's toy stands in, by the hash of its
    weights) and falls back to all runs, then 0.04, on another."""
    import statistics

    from conftest import LEARNING_BARS, learning_bar

    from evals import ALGORITHMS

    with open(LEARNING_BARS) as f:
        data = json.load(f)
    names = {"covpo_clip", "covpo_kl", *(a for a in ALGORITHMS if a != "covpo")}
    assert set(data["summary"]) == names
    for name in names:
        runs = [r for r in data["runs"] if r["name"] == name]
        assert sorted((r["toy"], r["seed"]) for r in runs) == [(t, s) for t in ("seed0", "seed1") for s in (1, 2, 3)]
        for toy, summary in data["summary"][name].items():
            gains = [r["gain"] for r in runs if toy in ("all", r["toy"])]
            assert summary["gains"] == gains
            assert summary["mean"] == pytest.approx(statistics.mean(gains), abs=1e-12)
            assert summary["std"] == pytest.approx(statistics.stdev(gains), abs=1e-12)
    grpo = [r for r in data["runs"] if r["name"] == "grpo"]
    digests = {r["toy"]: r["toy_sha256"] for r in grpo}
    assert len(set(digests.values())) == 2  # the two toys' weights differ
    for toy, digest in digests.items():
        gains = [r["gain"] for r in grpo if r["toy"] == toy]
        spread = max(statistics.stdev(gains), 0.01)
        assert learning_bar("grpo", digest=digest) == max(statistics.mean(gains) - 3 * spread, 0.04)
    other = tmp_path / "other" / "model"
    other.mkdir(parents=True)
    (other / "model.safetensors").write_bytes(b"another CPU's toy")
    everything = [r["gain"] for r in grpo]
    assert learning_bar("grpo", str(tmp_path / "other")) == max(
        statistics.mean(everything) - 3 * statistics.stdev(everything), 0.04)


def test_server_overlap_runs_small():
    from benchmarks import server_overlap

    table = server_overlap.main(["--generate_s", "0.05", "--train_s", "0.05", "--lags", "0,1", "--steps", "4"])
    rows = [line for line in table.splitlines() if re.match(r"^\| [01] \|", line)]
    assert len(rows) == 2, table


def benchmark_runs(sources: dict[str, str], names: list[str]) -> dict[str, list[str]]:
    """{benchmark name: the tests that run it} over test files' `sources` ({file: text}). A test runs benchmarks/N.py
    when its own code, or that of a function of its file it calls (at any depth), executes the file (the string
    "N.py" in an expression: a path given to a subprocess or runpy) or calls the module's entry point (N.main(...)
    or N.prepare(...) through `from benchmarks import N`, or main imported from benchmarks.N). A name in a
    docstring, a comment or an import alone, or a helper of the benchmark's module called, does not count."""
    runs = {name: [] for name in names}
    for file, text in sources.items():
        tree = ast.parse(text)
        modules, mains = {}, {}  # local name -> benchmark: the module object, its entry point
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
                modules.update({a.asname or a.name: a.name for a in node.names if a.name in runs})
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
                name = node.module.split(".", 1)[1]
                mains.update({a.asname or a.name: name for a in node.names if a.name in ENTRY_POINTS})
            elif isinstance(node, ast.Import):
                modules.update({a.asname: a.name.split(".", 1)[1] for a in node.names
                                if a.asname and a.name.startswith("benchmarks.")})
        functions = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}

        def direct(function: ast.FunctionDef) -> tuple[set[str], set[str]]:
            """(benchmarks run in the function's own code, the functions of this file it calls)."""
            found, called, stack = set(), set(), list(function.body)
            while stack:
                node = stack.pop()
                if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                    continue  # a docstring
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found |= {n for n in runs if node.value == f"{n}.py" or node.value.endswith(f"/{n}.py")}
                if isinstance(node, ast.Call):
                    f = node.func
                    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.attr in ENTRY_POINTS:
                        found |= {modules[f.value.id]} if f.value.id in modules else set()
                    if isinstance(f, ast.Name):
                        found |= {mains[f.id]} if f.id in mains else set()
                        called |= {f.id} if f.id in functions else set()
                stack.extend(ast.iter_child_nodes(node))
            return found, called

        own = {name: direct(f) for name, f in functions.items()}
        for test in (name for name in functions if name.startswith("test_")):
            seen, todo, found = {test}, [test], set()
            while todo:
                benchmarks, called = own[todo.pop()]
                found |= benchmarks
                todo += [c for c in called if c not in seen]
                seen |= called
            for name in found:
                runs[name].append(f"{file}::{test}")
    return runs


ENTRY_POINTS = ("main", "prepare")  # prepare: qwen3_shape's task, what benchmarks/step_time.py --shape qwen3 runs


def test_every_benchmark_script_has_a_smoke_test():
    """Each benchmarks/*.py is run by some test (benchmark_runs: its file executed or its entry point called), not
    merely named: a benchmark that no test runs breaks silently."""
    sources = {f: open(os.path.join(REPO, "tests", f)).read() for f in sorted(os.listdir(os.path.join(REPO, "tests")))
               if f.endswith(".py")}
    names = sorted(f[: -len(".py")] for f in os.listdir(os.path.join(REPO, "benchmarks"))
                   if f.endswith(".py") and f != "__init__.py")
    for name, tests in benchmark_runs(sources, names).items():
        assert tests, f"benchmarks/{name}.py: no test runs it (executes benchmarks/{name}.py or calls its main)"


def test_a_benchmark_named_but_not_run_has_no_smoke_test():
    """benchmark_runs on made-up test files: a name in a docstring, a comment, an import or a helper's call is not a
    run; the file run by a subprocess in a helper a test calls, or main called, is."""
    named_only = '''
from benchmarks import alpha
from benchmarks.beta import make_batch


def test_mentions():
    """alpha.py and benchmarks/beta.py are fine."""
    # benchmarks/alpha.py runs elsewhere
    make_batch(alpha.SIZE)
'''
    run = '''
import subprocess
from benchmarks import beta


def helper(tmp):
    return subprocess.run(["python", os.path.join("benchmarks", "alpha.py"), tmp])


def test_alpha(tmp_path):
    helper(str(tmp_path))


def test_beta():
    beta.main(["--small"])
'''
    assert benchmark_runs({"a.py": named_only}, ["alpha", "beta"]) == {"alpha": [], "beta": []}
    expected = {"alpha": ["b.py::test_alpha"], "beta": ["b.py::test_beta"]}
    assert benchmark_runs({"b.py": run}, ["alpha", "beta"]) == expected
