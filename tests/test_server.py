"""Server mode (--server_url): the rollout server (common/engines/serve.py), its client
(common/engines/server_client.py) and the filesystem weight transport; end-to-end, a trainer against a server process on
the toy (CPU)."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import HTTPServer
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, free_port, launch, read_metrics, run_script, subprocess_env
from safetensors.torch import load_file
from test_train import SMALL, assert_same_weights, final_weights, run_interrupted

import grpo
from common.engines.serve import Sampler, load_version, make_handler
from common.engines.server_client import ServerEngine, call, write_version


def toy_model_path(workdir) -> str:
    return os.path.join(str(workdir), "runs", "toy", "model")


@pytest.fixture
def served(in_toy_workdir, tmp_path):
    """A rollout server on the toy model in a thread of this process: (url, its Sampler)."""
    sampler = Sampler(toy_model_path(in_toy_workdir), str(tmp_path / "sync"), "hf", "float32", 0, 64)
    os.makedirs(sampler.sync_dir, exist_ok=True)
    server = HTTPServer(("localhost", 0), make_handler(sampler))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://localhost:{server.server_port}", sampler
    server.shutdown()
    server.server_close()


class FakeArgs:
    def __init__(self, url, timeout=30.0, dtype="float32", rollout_lag=0, old_logp_source="trainer"):
        self.server_url, self.server_timeout, self.dtype = url, timeout, dtype
        self.rollout_lag, self.old_logp_source = rollout_lag, old_logp_source
        self.dynamic_sampling, self.max_turns = False, 1


def local_engine(sampler):
    from common.engines.rollout import HFEngine

    return HFEngine(sampler.tokenizer, sampler.accelerator)


PROMPTS = [[3, 4, 5], [3, 4, 5], [6, 7], [8, 9, 10, 11]]
SEEDS = [11, 12, 13, 14]
SAMPLING = dict(max_tokens=6, temperature=1.0, top_p=1.0)


def test_write_version_renames_a_complete_folder_into_place(tmp_path):
    buckets = [[("a", torch.ones(2))], [("b", torch.zeros(3))]]
    final = write_version(iter(buckets), str(tmp_path), 3)
    assert final == str(tmp_path / "version_3")
    assert sorted(os.listdir(final)) == ["model-00000.safetensors", "model-00001.safetensors"]
    assert os.listdir(tmp_path) == ["version_3"]  # no temporary folder left

    def broken():  # the trainer dies while writing: no version_4 appears, the last complete one stays
        yield [("a", torch.ones(2))]
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        write_version(broken(), str(tmp_path), 4)
    assert os.listdir(tmp_path) == ["version_3"]  # neither a version_4 nor its temporary folder
    write_version(iter([[("a", torch.full((2,), 7.0))]]), str(tmp_path), 3)  # an earlier run's version_3 replaced
    assert sorted(os.listdir(final)) == ["model-00000.safetensors"]


def test_the_server_samples_what_the_local_engine_samples_before_and_after_a_sync(served):
    url, sampler = served
    client = ServerEngine(FakeArgs(url), sampler.accelerator)  # no initial push: version 0 is the --model files
    local = local_engine(sampler)
    assert client.generate(None, PROMPTS, SEEDS, **SAMPLING) == local.generate(sampler.model, PROMPTS, SEEDS,
                                                                               **SAMPLING)
    from transformers import AutoModelForCausalLM

    moved = AutoModelForCausalLM.from_pretrained(sampler.model_path, dtype=torch.float32)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    client.push_weights(moved)
    client.wait()  # the sync is sent in order, before any later request
    assert client.version == sampler.version == 1
    assert sorted(os.listdir(sampler.sync_dir)) == ["version_1"]
    for name, p in sampler.model.named_parameters():
        assert torch.equal(p, dict(moved.named_parameters())[name]), name
    ids, logps = client.generate(None, PROMPTS, SEEDS, **SAMPLING)
    want_ids, want_logps = local.generate(moved, PROMPTS, SEEDS, **SAMPLING)
    assert ids == want_ids and logps == want_logps  # JSON carries the floats exactly
    client.push_weights(moved)  # version 2 replaces version 1 on disk
    client.wait()
    assert sorted(os.listdir(sampler.sync_dir)) == ["version_2"]


def test_tool_rollouts_budgets_and_stop_strings_reach_the_server(served):
    """Multi-turn rollouts (common/engines/multiturn.py) ask for one budget per prompt and stop strings: the same
    rows."""
    url, sampler = served
    client = ServerEngine(FakeArgs(url), sampler.accelerator)
    prompts = [sampler.tokenizer.encode(p) for p in ("50+13=", "37+68=", "2+11=", "73+81=")]
    kwargs = dict(max_tokens=[6, 2, 4, 6], temperature=1.0, top_p=0.9, stop=["1", "5"])
    want = local_engine(sampler).generate(sampler.model, prompts, SEEDS, **kwargs)
    assert client.generate(None, prompts, SEEDS, **kwargs) == want
    assert [len(c) for c in want[0]] != [6, 2, 4, 6]  # precondition: some row stopped early (a string or EOS)


def test_a_generate_request_for_another_version_is_refused(served):
    url, _ = served
    body = dict(prompt_ids=PROMPTS, seeds=SEEDS, stop=None, version=5, **SAMPLING)
    with pytest.raises(SystemExit, match="refused the generate: the trainer expects weights version 5, this server "
                                         "holds version 0"):
        call(url, "/generate", body, 30, "generate")


def test_a_sync_of_weights_the_server_cannot_see_or_use_is_refused(served, tmp_path):
    url, sampler = served
    with pytest.raises(SystemExit, match="refused the weight sync: WeightError: no weights in .*version_7"):
        call(url, "/sync", {"version": 7}, 30, "weight sync")
    write_version(iter([[("not.a.parameter", torch.ones(1))]]), sampler.sync_dir, 8)
    with pytest.raises(SystemExit, match="does not hold this model's parameters"):
        call(url, "/sync", {"version": 8}, 30, "weight sync")
    assert sampler.version == 0
    with pytest.raises(Exception, match="does not hold"):
        load_version(sampler.model, sampler.sync_dir, 8)


def test_a_server_that_does_not_answer_stops_the_client_within_the_timeout():
    silent = socket.socket()  # accepts connections (the kernel's backlog), never answers: a hung server
    silent.bind(("localhost", 0))
    silent.listen(8)
    url = f"http://localhost:{silent.getsockname()[1]}"
    start = time.monotonic()
    with pytest.raises(SystemExit) as e:
        call(url, "/sync", {"version": 1}, 1.0, "weight sync (version 1)")
    assert time.monotonic() - start < 5
    assert str(e.value) == (f"error: the rollout server at {url} did not answer the weight sync (version 1) within "
                            f"1 s (--server_timeout): it is hung, or slower than the limit")
    silent.close()
    with pytest.raises(SystemExit, match=r"did not answer the generate \(.*refused.*\): is vllm serve \(or python -m "
                                         r"common.engines.serve\)"):
        call(f"http://localhost:{free_port()}", "/generate", {}, 1.0, "generate")


def refusal_by_a_stub(answer) -> str:
    """The one-line refusal of a run whose --server_url is a stub service answering every GET with answer(path)."""
    from http.server import BaseHTTPRequestHandler

    class Stub(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(answer(self.path))

        def log_message(self, *args):
            pass

    stub = HTTPServer(("127.0.0.1", 0), Stub)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    try:
        with pytest.raises(SystemExit) as e:
            run_script(grpo, SMALL + ["--server_url", f"http://127.0.0.1:{stub.server_port}", "--run_name", "stub"])
    finally:
        stub.shutdown()
    assert "\n" not in str(e.value) and str(e.value).startswith("error: "), str(e.value)
    return str(e.value)


@pytest.mark.parametrize("body", [b"<html><body>It works!</body></html>", b'{"status": "ok"}'])
def test_another_service_at_the_server_url_is_refused_in_one_line(in_toy_workdir, body):
    """A web page or another JSON service at --server_url (it gave a KeyError or a traceback): one line naming what
    answered, before any weights load."""
    message = refusal_by_a_stub(lambda path: body)
    assert ("not JSON: is vllm serve" in message) if body.startswith(b"<") else \
        ("the service there is neither vllm serve nor python -m common.engines.serve" in message), message


@pytest.mark.parametrize("backend, message", [
    (None, "vllm serve runs without --weight-transfer-config; start it with --weight-transfer-config "
           "'{\"backend\": \"disk\"}'"),
    ("ipc", "vllm serve runs the weight-transfer backend 'ipc'; start it with --weight-transfer-config"),
    ("nccl", "vllm serve takes its weights over NCCL, which needs a CUDA GPU in the trainer too (this process sees "
             "none)"),
])
def test_a_vllm_serve_whose_weights_the_trainer_cannot_send_is_refused(in_toy_workdir, backend, message):
    """vllm serve's weight-transfer backend is read from its configuration (/server_info): without one, with one
    the trainer does not drive, or NCCL from a trainer without a GPU, the run is refused in one line before any
    weights load (it used to fail at the first sync, after the model had loaded)."""
    if backend == "nccl" and torch.cuda.is_available():
        pytest.skip("a trainer with a GPU may use NCCL")
    config = {"weight_transfer_config": None if backend is None else {"backend": backend}}
    routes = {"/health": b"", "/weight_info": b'{"weight_version": "default"}',  # as vllm serve answers them
              "/server_info?config_format=json": json.dumps({"vllm_config": config}).encode()}
    assert message in refusal_by_a_stub(routes.__getitem__)


@pytest.mark.parametrize("url, message", [
    ("localhost:8000", "--server_url 'localhost:8000': give http://HOST:PORT, where vllm serve (or python -m "
                       "common.engines.serve) listens"),
    ("http://localhost:{port}", "the rollout server at http://localhost:{port} did not answer the health check"),
])
def test_a_bad_server_url_is_refused_before_any_weights_load(in_toy_workdir, url, message):
    port = free_port()
    with pytest.raises(SystemExit) as e:
        run_script(grpo, SMALL + ["--server_url", url.format(port=port), "--run_name", "bad_url"])
    assert str(e.value).startswith("error: " + message.format(port=port)), str(e.value)
    assert "\n" not in str(e.value)


def test_a_server_with_another_dtype_is_refused(served):
    from common.engines.server_client import server_problems

    url, _ = served
    assert server_problems(FakeArgs(url)) == []
    assert server_problems(FakeArgs(url, dtype="bfloat16")) == [
        f"--server_url {url}: the server runs --dtype float32, the trainer --dtype bfloat16; start it with the "
        f"trainer's"]


def test_the_server_refuses_an_engine_it_cannot_run(tmp_path):
    from common.engines.rollout import vllm_installed
    from common.engines.serve import main

    if vllm_installed():
        pytest.skip("vLLM is installed here")
    with pytest.raises(SystemExit, match="--engine vllm needs vLLM"):
        main(["--model", "unused", "--sync_dir", str(tmp_path), "--engine", "vllm"])


def start_server(workdir, sync_dir: str, *extra: str, wait_s: float = 120) -> tuple[subprocess.Popen, str]:
    """`python -m common.engines.serve` on the toy, one thread (as the trainer `launch` starts): ready when it answers.
    Its output goes to server.log beside sync_dir (vLLM's would fill a pipe and block it)."""
    port = free_port()
    log_path = os.path.join(os.path.dirname(sync_dir), "server.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "common.engines.serve", "--model", toy_model_path(workdir),
                                 "--port", str(port), "--host", "localhost", "--sync_dir", sync_dir,
                                 "--dtype", "float32", *extra],
                                cwd=workdir, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://localhost:{port}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, open(log_path).read()[-3000:]
        try:
            urllib.request.urlopen(url + "/health", timeout=1).read()
            return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the rollout server did not start within {wait_s} s")


@pytest.mark.slow
def test_at_lag_0_server_mode_takes_exactly_the_colocated_steps(in_toy_workdir, tmp_path):
    """Same completions for the same seeds (the same rewards and sampler log-probs every step), the same weights
    after 3 steps, bit for bit; the canary stays ~0 (the server runs the trainer's weights)."""
    argv = SMALL + ["--total_steps", "3"]
    launch(in_toy_workdir, "grpo.py", argv + ["--run_name", "colocated"])
    server, url = start_server(in_toy_workdir, str(tmp_path / "sync"))
    try:
        launch(in_toy_workdir, "grpo.py", argv + ["--run_name", "served", "--server_url", url])
    finally:
        server.kill()
        server.wait()
    colocated, served = (os.path.join(in_toy_workdir, "runs", r) for r in ("colocated", "served"))
    assert_same_weights(final_weights(colocated, 3), final_weights(served, 3), atol=0)
    for a, b in zip(read_metrics(colocated), read_metrics(served), strict=True):
        same = {k for k in a if not k.startswith(("time/", "memory/"))}
        assert {k: a[k] for k in same} == {k: b[k] for k in same}
        assert b["rollout/logp_gap_mean"] < 1e-5
    assert os.listdir(tmp_path / "sync") == ["version_4"]  # the initial push and one per step; older ones removed
    assert_same_weights(pushed(tmp_path / "sync" / "version_4"), final_weights(served, 3), atol=0)


def pushed(folder) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(os.listdir(folder)) for k, v in load_file(os.path.join(folder, f)).items()}


@pytest.mark.slow
def test_two_processes_push_the_merged_lora_weights(in_toy_workdir, tmp_path):
    """LoRA under two processes (DDP): every process takes part in the push, the main one writes; the server
    receives the adapter merged into the base weights (what the checkpoint saves), not the initial policy."""
    server, url = start_server(in_toy_workdir, str(tmp_path / "sync"))
    argv = SMALL + ["--total_steps", "2", "--micro_batch_size", "2", "--lora_r", "4", "--lora_alpha", "8",
                    "--lora_target_modules", "q_proj,v_proj", "--run_name", "lora_served", "--server_url", url]
    try:
        launch(in_toy_workdir, "grpo.py", argv, num_processes=2)
    finally:
        server.kill()
        server.wait()
    run = os.path.join(in_toy_workdir, "runs", "lora_served")
    merged = final_weights(run, 2)
    base = load_file(os.path.join(toy_model_path(in_toy_workdir), "model.safetensors"))
    assert any(not torch.equal(base[k], merged[k]) for k in base if "q_proj" in k)  # precondition: the adapter moved
    assert os.listdir(tmp_path / "sync") == ["version_3"]
    assert_same_weights(pushed(tmp_path / "sync" / "version_3"), merged, atol=0)
    assert all(m["rollout/logp_gap_mean"] < 1e-5 for m in read_metrics(run))


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_server_that_stops_answering_stops_the_trainer_with_one_line(in_toy_workdir, tmp_path, how):
    """Killed (SIGKILL: connections refused at once) or hung (SIGSTOP: connections accepted, never answered), the
    server stops the trainer within --server_timeout, with one line naming it and the request; no silent hang (hung:
    at lag 1, with a request made ahead in flight)."""
    server, url = start_server(in_toy_workdir, str(tmp_path / "sync"))
    run_dir = os.path.join(in_toy_workdir, "runs", f"orphan_{how}")
    argv = SMALL + ["--total_steps", "10000", "--run_name", f"orphan_{how}", "--server_url", url,
                    "--server_timeout", "5"]
    if how == "hung":  # with requests made ahead (overlap): the one in flight times out, the others fail with it
        argv += ["--rollout_lag", "1", "--old_logp_source", "sampler"]
    trainer = subprocess.Popen([sys.executable, os.path.join(REPO, "grpo.py"), *argv], cwd=in_toy_workdir,
                               env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (os.path.exists(os.path.join(run_dir, "metrics.jsonl")) and read_metrics(run_dir)):
            assert trainer.poll() is None and time.monotonic() < deadline, trainer.communicate()[1][-3000:]
            time.sleep(0.2)
        server.send_signal(signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        stopped = time.monotonic()
        out, err = trainer.communicate(timeout=60)
        assert time.monotonic() - stopped < (10 if how == "killed" else 5 + 10)  # hung: the timeout, then the exit
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        trainer.kill()
    assert trainer.returncode == 1 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: the rollout server at {url} did not answer the "), err[-3000:]
    if how == "hung":
        assert "within 5 s (--server_timeout)" in last, last


def moved_copy(model, seed: int | None):
    """A copy of `model` with every parameter moved a little (seed None: not moved): the weights of a later step."""
    import copy

    moved = copy.deepcopy(model)
    if seed is None:  # a copy
        return moved
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    return moved


def test_the_overlap_queue_requests_k_steps_ahead_each_sampled_by_the_weights_of_its_step(served):
    """Lag 2, 5 steps: before step s trains, the requests of steps s+1..s+2 are made (never one past the last step);
    step s's rows come from the weights pushed at step max(s-2, 0), as the local engine samples them with those
    weights, and its staleness (min(s, 2)) is what the batch says."""
    from common.engines.server_client import OverlapQueue

    url, sampler = served
    client, local = ServerEngine(FakeArgs(url), sampler.accelerator), local_engine(sampler)
    requests = lambda index: (PROMPTS, [s + 100 * index for s in SEEDS])  # noqa: E731
    queue = OverlapQueue(2, client, requests, **SAMPLING)
    weights = [moved_copy(sampler.model, seed=None)]  # each step's weights (version 0: --model; the server's own
    # model object is overwritten by each sync)
    for step in range(5):
        for index in queue.steps_to_sample(step, total_steps=5):
            ids, logps = client.generate(None, *requests(index), **SAMPLING)
            queue.put(SimpleNamespace(ids=ids, logps=logps), sampled_at=step)
        batch = queue.take(step)
        assert batch.staleness == min(step, 2) and batch.sampled_at == max(step - 2, 0)
        assert sorted(queue.sent) == list(range(step + 1, min(step + 3, 5)))  # in flight while step s trains
        assert len(client.ahead) == len(queue.sent)
        want = local.generate(weights[batch.sampled_at], *requests(step), **SAMPLING)
        assert (batch.ids, batch.logps) == want
        weights.append(moved_copy(weights[-1], step))  # the optimizer step
        client.push_weights(weights[-1])
    client.wait()
    assert sampler.version == 5 and os.listdir(sampler.sync_dir) == ["version_5"]


def test_a_failed_sync_fails_every_request_after_it_with_its_message(served, tmp_path):
    """The trainer writes where the server does not look: the sync is refused, and the generate request queued
    behind it is not answered with the old weights but fails with the sync's message."""
    url, sampler = served
    client = ServerEngine(FakeArgs(url), sampler.accelerator)
    client.sync_dir = str(tmp_path / "elsewhere")
    os.makedirs(client.sync_dir)
    client.push_weights(moved_copy(sampler.model, 0))  # returns at once: the sync is queued
    message = r"refused the weight sync \(version 1 in .*elsewhere\): WeightError: no weights in .*sync/version_1"
    with pytest.raises(SystemExit, match=message):
        client.generate(None, PROMPTS, SEEDS, **SAMPLING)
    with pytest.raises(SystemExit, match=message):  # and every later one
        client.generate(None, PROMPTS, SEEDS, **SAMPLING)
    assert sampler.version == 0


@pytest.mark.parametrize("flags, message", [
    ({}, "add --old_logp_source sampler"),
    ({"old_logp_source": "sampler", "dynamic_sampling": True}, "--dynamic_sampling with --server_url and "
                                                               "--rollout_lag 2: its later requests depend"),
    ({"old_logp_source": "sampler", "max_turns": 3}, "--max_turns 3 with --server_url"),
])
def test_settings_that_cannot_overlap_are_refused(served, flags, message):
    from common.engines.server_client import server_problems

    url, _ = served
    args = FakeArgs(url, rollout_lag=2)
    assert server_problems(FakeArgs(url, rollout_lag=2, old_logp_source="sampler")) == []
    for name, value in flags.items():
        setattr(args, name, value)
    problems = server_problems(args)
    assert len(problems) == 1 and message in problems[0], problems


@pytest.mark.slow
def test_with_lag_server_mode_overlaps_takes_the_colocated_steps_and_resumes_exactly(in_toy_workdir, served,
                                                                                      monkeypatch):
    """Lag 2, the behaviour log-probs the sampler's: the server run's weights after 4 steps equal the colocated
    run's bit for bit, with equal metrics and staleness 0, 1, 2, 2. Interrupted at step 3 and resumed from the step
    2 checkpoint (which saved the answers of the two requests made ahead), it ends with the same weights again."""
    url, sampler = served
    argv = SMALL + ["--total_steps", "4", "--save_steps", "2", "--rollout_lag", "2", "--old_logp_source", "sampler"]
    colocated = run_script(grpo, argv + ["--run_name", "overlap_colocated"])
    straight = run_script(grpo, argv + ["--run_name", "overlap_served", "--server_url", url])
    assert_same_weights(final_weights(colocated, 4), final_weights(straight, 4), atol=0)
    for a, b in zip(read_metrics(colocated), read_metrics(straight), strict=True):
        same = {k for k in a if not k.startswith(("time/", "memory/"))}
        assert {k: a[k] for k in same} == {k: b[k] for k in same}
    assert [m["rollout/staleness"] for m in read_metrics(straight)] == [0, 1, 2, 2]

    run_interrupted(argv + ["--run_name", "overlap_interrupted", "--server_url", url], monkeypatch, at_call=3)
    interrupted = os.path.join("runs", "overlap_interrupted")
    saved = os.listdir(os.path.join(interrupted, "checkpoints", "step_2", "state"))
    assert "rollout_requests_0.pt" in saved  # precondition: the answers of steps 3 and 4, sampled ahead
    resumed = run_script(grpo, argv + ["--resume_from", interrupted, "--server_url", url])
    assert_same_weights(final_weights(straight, 4), final_weights(resumed, 4), atol=0)
    assert [m["rollout/staleness"] for m in read_metrics(resumed)] == [0, 1, 2, 2]


@pytest.mark.slow
def test_two_processes_overlapped_send_one_request_per_step_and_train_on_the_same_rows(in_toy_workdir, served):
    """Lag 2, two training processes (gloo): every process's rows go into the main process's one request per step
    and come back to their process. The server samples the same rows as for one process (the same request), so
    every step's rewards equal the one-process run's; the weights agree to the usual process-count tolerance."""
    url, sampler = served
    argv = SMALL + ["--total_steps", "3", "--micro_batch_size", "2", "--rollout_lag", "2", "--old_logp_source",
                    "sampler", "--server_url", url]
    launch(in_toy_workdir, "grpo.py", argv + ["--run_name", "overlap_served_1"])
    version_after_one = sampler.version
    launch(in_toy_workdir, "grpo.py", argv + ["--run_name", "overlap_served_2"], num_processes=2)
    assert sampler.version == version_after_one + 4  # the initial push and one per step, from the main process only
    one, two = (os.path.join(in_toy_workdir, "runs", r) for r in ("overlap_served_1", "overlap_served_2"))
    for a, b in zip(read_metrics(one), read_metrics(two), strict=True):
        assert (a["reward/mean"], a["completion/tokens"]) == (b["reward/mean"], b["completion/tokens"])
        assert a["rollout/staleness"] == b["rollout/staleness"]
    assert_same_weights(final_weights(one, 3), final_weights(two, 3), atol=1e-5)


def test_an_answer_the_client_cannot_read_fails_the_request_instead_of_hanging(served):
    url, sampler = served
    client = ServerEngine(FakeArgs(url), sampler.accelerator)
    future = client.post("/health", None, "health check", then=lambda answer: answer["no such field"])
    with pytest.raises(SystemExit, match=r"to the health check: KeyError\('no such field'\)"):
        future.result(timeout=30)
    with pytest.raises(SystemExit, match="to the health check"):  # and every request after it
        client.generate(None, PROMPTS, SEEDS, **SAMPLING)
