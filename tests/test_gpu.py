"""GPU acceptance (scripts/gpu_check.sh runs this on a GPU machine): the scripts on CUDA, bf16 and fp32, with and
without LoRA, FSDP2 in one process, the toy learning on the GPU, server mode (a rollout server beside the trainer on
the same GPU), and the chunked LM-head log-probs against the naive
form on CUDA in bf16 (values, gradients, peak memory). Models and data are built here (the toy; a random model of a
large vocabulary): nothing is downloaded. Every test is marked `gpu` and skipped where there is no CUDA device, so the
CPU machines collect them (they import and are wired) without running them."""

import importlib
import json
import os

import pytest
import torch
from conftest import REPO, launch, read_metrics, run_script
from test_train import SMALL

from benchmarks.logprobs_memory import make_batch, naive_completion_logprobs, tiny_model
from common.logprobs import completion_logprobs
from evals import ALGORITHMS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check.sh)")]
SCRIPTS = {name: importlib.import_module(name) for name in ALGORITHMS}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_rl_step_on_cuda(in_toy_workdir, name, dtype, lora):
    """One stale step (two mini-batches, two passes: every estimator's batch statistics), with its KL term."""
    run_name = f"gpu_{name}_{dtype}_{'lora' if lora else 'full'}"
    argv = SMALL + ["--dtype", dtype, "--mini_batch_size", "8", "--num_iterations", "2", "--beta", "0.05",
                    "--run_name", run_name] + (["--lora_r", "4"] if lora else [])
    run = run_script(SCRIPTS[name], argv)
    m = read_metrics(run)[-1]
    assert all(v == v for v in m.values() if isinstance(v, float)), m  # no NaN anywhere
    assert 0 < m["memory/peak_gib"] < 4, m  # torch.cuda.max_memory_allocated, not the process's RSS
    assert m["policy/kl"] >= 0 and m["optim/grad_norm"] > 0, m


def test_fsdp2_in_one_process(in_toy_workdir):
    """configs/accelerate/fsdp2.yaml on one GPU: the policy's parameters are DTensors, the step completes. The types
    come from tests/sharding_report.py, which runs grpo.py and reports every model accelerate prepares (the policy;
    the reference is sharded by common/models/sharding.py without a report): FSDP2, every parameter a DTensor, which one
    process holds whole."""
    report = os.path.join(in_toy_workdir, "gpu_fsdp2_sharding.jsonl")
    if os.path.exists(report):
        os.remove(report)
    argv = [os.path.join(REPO, "grpo.py"), *SMALL, "--run_name", "gpu_fsdp2", "--beta", "0.05"]
    launch(in_toy_workdir, os.path.join("tests", "sharding_report.py"), argv, num_processes=1,
           config=os.path.join(REPO, "configs", "accelerate", "fsdp2.yaml"), env={"SHARDING_REPORT": report})
    with open(report) as f:
        reports = [json.loads(line) for line in f]
    assert len(reports) >= 1 and all(r["rank"] == 0 for r in reports), reports
    for r in reports:
        assert r["distributed_type"] == "DistributedType.FSDP", r["distributed_type"]
        assert r["params"], "a prepared model without parameters"
        for name, (kind, held, full) in r["params"].items():
            assert kind == "DTensor" and held == full, (name, kind, held, full)
    m = read_metrics(os.path.join(in_toy_workdir, "runs", "gpu_fsdp2"))[-1]
    assert m["optim/grad_norm"] > 0 and m["memory/peak_gib"] > 0, m


def test_toy_learns_on_the_gpu(in_toy_workdir):
    """200 steps of the toy preset on CUDA: held-out greedy accuracy rises by the CPU test's bar or more."""
    run = run_script(SCRIPTS["grpo"], ["--preset", "toy", "--total_steps", "200", "--eval_steps", "100", "--run_name",
                            "gpu_learns"])
    evals = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(evals) == 3 and evals[-1] >= evals[0] + 0.04, evals


def test_server_mode_on_cuda(in_toy_workdir, tmp_path):
    """A rollout server (python -m common.engines.serve, the HF engine) and a trainer on the same GPU, each a process,
    the weights synced through the filesystem: at lag 0 the first step's rewards equal the colocated run's (the same
    completions) and at every step the server's log-probs are the trainer's (each sync landed on CUDA); at lag 2 with
    the sampler's log-probs, generation overlaps training and no batch is more than 2 steps stale."""
    from test_server import start_server

    argv = SMALL + ["--total_steps", "3"]
    colocated = run_script(SCRIPTS["grpo"], argv + ["--run_name", "gpu_colocated"])
    server, url = start_server(in_toy_workdir, str(tmp_path / "sync"))
    try:
        served = run_script(SCRIPTS["grpo"], argv + ["--run_name", "gpu_served", "--server_url", url])
        lagged = run_script(SCRIPTS["grpo"], SMALL + ["--total_steps", "4", "--rollout_lag", "2", "--old_logp_source",
                                                      "sampler", "--run_name", "gpu_served_lag2", "--server_url", url])
    finally:
        server.kill()
        server.wait()
    assert read_metrics(colocated)[0]["reward/mean"] == read_metrics(served)[0]["reward/mean"]
    assert all(m["rollout/logp_gap_mean"] < 1e-4 for m in read_metrics(served)), read_metrics(served)
    assert [m["rollout/staleness"] for m in read_metrics(lagged)] == [0, 1, 2, 2]


@pytest.mark.vllm
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL puts the trainer and the server on two GPUs")
def test_vllm_serve_nccl_sync(in_toy_workdir):
    """vllm serve on GPU 1 with --weight-transfer-config '{"backend": "nccl"}', the trainer on GPU 0: every step's
    weights reach the server over NCCL (vLLM's own trainer engine, common/engines/nccl_sync.py): the server's log-probs
    stay the trainer's while the weights move (a sync that did not land would open the gap at the learning rate below),
    every answer names the version pushed last, and lag 2 overlaps as with the disk engine."""
    from test_vllm_serve import start_vllm_serve, stop, weight_version

    server, url = start_vllm_serve(in_toy_workdir, "vllm_serve_nccl.log", backend="nccl",
                                   env={"CUDA_VISIBLE_DEVICES": "1"})
    try:
        argv = SMALL + ["--server_url", url, "--dtype", "float32", "--learning_rate", "1e-3"]
        served = run_script(SCRIPTS["grpo"], argv + ["--total_steps", "3", "--run_name", "gpu_nccl"])
        assert int(weight_version(url)) >= 3, weight_version(url)  # a version per push, not the server's "default"
        lagged = run_script(SCRIPTS["grpo"], argv + ["--total_steps", "4", "--rollout_lag", "2", "--old_logp_source",
                                                     "sampler", "--run_name", "gpu_nccl_lag2"])
    finally:
        stop(server)
    assert all(m["rollout/logp_gap_mean"] < 1e-3 for m in read_metrics(served)), read_metrics(served)
    assert [m["rollout/staleness"] for m in read_metrics(lagged)] == [0, 1, 2, 2]


@pytest.mark.parametrize("V", [32_000, 152_064])
def test_chunked_head_logprobs_match_naive_in_bf16_and_use_less_memory(V):
    """bf16 on CUDA: the same log-probs, entropies and gradients as the naive log-softmax over (B, T, V), with a
    lower peak of CUDA memory (the naive form holds fp32 logits of the whole batch)."""
    T, device = 64, torch.device("cuda")
    model = tiny_model(V, torch.bfloat16).to(device)
    input_ids, attention_mask, mask = (t.to(device) for t in make_batch(V, 4, 32, T))
    results = {}
    for label, fn in [("naive", naive_completion_logprobs), ("chunked", completion_logprobs)]:
        model.zero_grad()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        logp, entropy = fn(model, input_ids, attention_mask, T, 0.9, entropy_grad=True)
        (logp * mask).sum().add((entropy * mask).sum()).backward()
        peak = torch.cuda.max_memory_allocated(device) - base
        results[label] = (logp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()},
                          peak)
    (lp_n, ent_n, grad_n, peak_n), (lp_c, ent_c, grad_c, peak_c) = results["naive"], results["chunked"]
    m = mask.bool()
    torch.testing.assert_close(lp_c[m], lp_n[m], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ent_c[m], ent_n[m], atol=1e-4, rtol=1e-4)
    for n in grad_n:
        torch.testing.assert_close(grad_c[n], grad_n[n], atol=2e-2, rtol=2e-2, msg=n)
    assert peak_c < peak_n, (peak_c, peak_n)
    print(f"V={V}: peak CUDA memory above the model, naive {peak_n / 2**20:.0f} MiB, chunked {peak_c / 2**20:.0f} MiB")


def test_left_padded_rows_give_finite_logprobs_and_gradients_in_bf16():
    """Two layers (a NaN at a padding position reaches real tokens only through a second layer), left-padded
    prompts and widths of 64 (where torch 2.11 picks cuDNN's attention, which returns NaN for query rows with no
    key): after padding_safe_attention, every log-prob and gradient is finite (an H100 run stopped at step 1 with a
    NaN gradient norm before it)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from common.models.placement import padding_safe_attention

    padding_safe_attention()
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, pad_token_id=0, eos_token_id=1)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).cuda()
    input_ids, attention_mask, mask = (t.cuda() for t in make_batch(512, 8, 64, 128))
    logp, _ = completion_logprobs(model, input_ids, attention_mask, 128, 1.0)
    (logp * mask).sum().backward()
    assert torch.isfinite(logp).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
