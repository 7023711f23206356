"""Sharded training on 2 CPU processes (gloo): FSDP2 (configs/accelerate/fsdp2.yaml) and DeepSpeed ZeRO-2/3 against DDP.

The processes are started by `accelerate launch` through tests/dist_runner.py (conftest.launch), which is where the
two decisions accelerate 1.15 does not make on a CPU are made: the processes join one gloo group, and FSDP applies.
Everything else is accelerate's own FSDP2 path: fully_shard, DTensor parameters, sharded optimizer state,
distributed checkpoints, full state dicts for save_pretrained. Overridden from the config files for the CPU, as
stated in conftest.launch: --num_processes 2, --mixed_precision no (fp32, so steps compare exactly).
"""

import glob
import json
import os
import shutil
import subprocess
import sys

import conftest
import pytest
import torch
import yaml
from conftest import REPO, deepspeed_cpu_op_built, launch, read_metrics, subprocess_env
from safetensors.torch import load_file
from test_snib import STALE, assert_same_update, stale_update
from test_train import SMALL, assert_same_gradient, assert_same_weights, final_weights, sgd_gradient

FSDP2 = os.path.join(REPO, "configs", "accelerate", "fsdp2.yaml")
pytestmark = pytest.mark.slow


def sharding_reports(path: str) -> list[dict]:
    """dist_runner's SHARDING_REPORT lines: one per process and model prepared by accelerate."""
    with open(path) as f:
        return [json.loads(line) for line in f]


def assert_sharded(reports: list[dict], num_processes: int = 2, kind: str = "DTensor"):
    """Every parameter of the policy is sharded: a DTensor (FSDP2) or a ZeRO-3 partition, and the parts held by the
    processes (one each) add up to the whole tensor (ZeRO-3 pads its last part: at least the whole)."""
    distributed = {"DTensor": "DistributedType.FSDP", "ZeRO-3": "DistributedType.DEEPSPEED"}[kind]
    policy = [r for r in reports if any(k == kind for k, _, _ in r["params"].values())]
    assert sorted(r["rank"] for r in policy) == list(range(num_processes)), reports
    assert all(r["distributed_type"] == distributed for r in policy)
    for name, (k, _, full) in policy[0]["params"].items():
        assert k == kind, name
        held = sum(r["params"][name][1] for r in policy)
        assert held == full if kind == "DTensor" else full <= held < full + num_processes, name
        assert all(r["params"][name][1] < full for r in policy) or full < num_processes, name


def run_twice(cwd, script: str, name: str, argv: list[str], lr: float) -> tuple[dict, dict, list[dict]]:
    """One RL step with SGD under DDP and under FSDP2 (2 processes each): (DDP update, FSDP2 update, FSDP2's
    sharding reports). The DDP run's reports must show 2 connected processes and no DTensor."""
    reports = {}
    updates = {}
    for kind, config in (("ddp", None), ("fsdp2", FSDP2)):
        report = os.path.join(cwd, f"{name}_{kind}.jsonl")
        if os.path.exists(report):
            os.remove(report)
        updates[kind] = sgd_gradient(cwd, f"{name}_{kind}", argv, num_processes=2, script=script, lr=lr,
                                     config=config, env={"SHARDING_REPORT": report})
        reports[kind] = sharding_reports(report)
    assert {r["rank"] for r in reports["ddp"]} == {0, 1}
    assert {r["distributed_type"] for r in reports["ddp"]} == {"DistributedType.MULTI_CPU"}
    assert not any(kind == "DTensor" for r in reports["ddp"] for kind, _, _ in r["params"].values())
    return updates["ddp"], updates["fsdp2"], reports["fsdp2"]


@pytest.mark.precondition
def test_fsdp2_shards_the_policy_and_takes_the_ddp_step(in_toy_workdir):
    """grpo.py with its reference model (beta 0.1): one optimizer step of 16 rows, 4 micro-batches of 2 per process."""
    argv = SMALL + ["--micro_batch_size", "2", "--beta", "0.1"]
    ddp, fsdp2, reports = run_twice(in_toy_workdir, "grpo.py", "grpo", argv, lr=1.0)
    assert_sharded(reports)
    assert_same_gradient(ddp, fsdp2)
    m_ddp, m_fsdp = (read_metrics(os.path.join("runs", f"grpo_{k}"))[-1] for k in ("ddp", "fsdp2"))
    assert m_ddp["reward/mean"] == m_fsdp["reward/mean"]  # the same completions
    assert m_ddp["optim/grad_norm"] == pytest.approx(m_fsdp["optim/grad_norm"], rel=1e-5)
    assert m_ddp["policy/kl"] == pytest.approx(m_fsdp["policy/kl"], rel=1e-5)


def test_a_build_lock_left_by_a_killed_process_is_removed_before_zero_runs(monkeypatch):
    """DeepSpeed's CPU op is built where every ZeRO process finds it (conftest.deepspeed_cpu_op_built); the lock file
    of a build killed half-way, which would keep every later ZeRO process waiting for ever, is gone before the next
    session's first ZeRO run, and the op is there."""
    folder = deepspeed_cpu_op_built()
    leftover = os.path.join(folder, "deepspeed_shm_comm", "lock")
    open(leftover, "w").close()
    monkeypatch.setattr(conftest, "DEEPSPEED_OP_BUILT", [])  # as a new session finds it
    assert deepspeed_cpu_op_built() == folder
    assert not os.path.exists(leftover)
    assert glob.glob(os.path.join(folder, "deepspeed_shm_comm", "*.so"))


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_deepspeed_zero_takes_the_ddp_step(in_toy_workdir, stage):
    """DeepSpeed's CPU accelerator (gloo), as requirements-cpu.txt installs it.
    grpo.py with its reference model: under ZeRO-3 the reference is a DeepSpeed inference engine over partitioned
    weights; at step 1 it is the policy, so the KL is 0 exactly when both forwards see the same weights."""
    argv = SMALL + ["--micro_batch_size", "2", "--beta", "0.1"]
    report = os.path.join(in_toy_workdir, f"{stage}.jsonl")
    if os.path.exists(report):
        os.remove(report)
    ddp = sgd_gradient(in_toy_workdir, f"{stage}_ddp", argv, num_processes=2)
    zero = sgd_gradient(in_toy_workdir, stage, argv, num_processes=2,
                        config=os.path.join(REPO, "configs", "accelerate", f"{stage}.yaml"),
                        env={"SHARDING_REPORT": report})
    assert_same_gradient(ddp, zero)
    if stage == "zero3":
        assert_sharded(sharding_reports(report), kind="ZeRO-3")
    m_ddp, m_zero = (read_metrics(os.path.join("runs", r))[-1] for r in (f"{stage}_ddp", stage))
    assert m_ddp["reward/mean"] == m_zero["reward/mean"] and m_zero["policy/kl"] == m_ddp["policy/kl"] == 0.0


@pytest.mark.precondition
@pytest.mark.parametrize("script", ["snib.py", "p3o.py"])
def test_fsdp2_takes_the_ddp_steps_with_batch_statistics(in_toy_workdir, script):
    """Stale data (2 mini-batches, 2 passes): SNIB's and P3O's no-grad pre-pass at the current weights runs on
    sharded weights, and its statistics are taken over both processes."""
    name = script[: -len(".py")]

    def stale_enough(m):  # the statistics are not trivial: SNIB's weights differ from 1, P3O's ESS cap binds
        return m["snib/weight_max"] > 1.01 if name == "snib" else m["p3o/capped_frac"] > 0.05

    _, lr, _ = stale_update(in_toy_workdir, script, f"{name}_stale_p1", STALE + ["--micro_batch_size", "8"],
                            stale_enough)
    ddp, fsdp2, reports = run_twice(in_toy_workdir, script, f"{name}_stale", STALE + ["--micro_batch_size", "2"], lr=lr)
    assert_sharded(reports)
    assert_same_update(ddp, fsdp2, f"{name} FSDP2 vs DDP (lr {lr})")  # the step stale_update found stale enough


@pytest.mark.parametrize("stage", ["fsdp2", "zero3"])
def test_sharded_run_resumes_exactly_and_saves_a_full_model_that_evals_run_loads(in_toy_workdir, stage):
    """AdamW (sharded state), a linear schedule: resuming from the FSDP2 or ZeRO-3 checkpoint of step 2 ends at the
    weights of the uninterrupted run's step 4. The model/ folder holds the whole model, as save_pretrained writes it."""
    config = os.path.join(REPO, "configs", "accelerate", f"{stage}.yaml")
    argv = SMALL + ["--total_steps", "4", "--save_steps", "2", "--lr_scheduler_type", "linear", "--warmup_steps", "1"]
    launch(in_toy_workdir, "grpo.py", argv + ["--run_name", f"{stage}_straight"], num_processes=2, config=config)
    straight = os.path.join("runs", f"{stage}_straight")
    state = os.listdir(os.path.join(straight, "checkpoints", "step_2", "state"))
    if stage == "fsdp2":
        assert "pytorch_model_fsdp_0" in state and "optimizer_0" in state  # accelerate's sharded (distcp) FSDP state
    else:  # DeepSpeed's own checkpoint: each process's partition of the weights and of the optimizer state
        parts = os.listdir(os.path.join(straight, "checkpoints", "step_2", "state", "pytorch_model"))
        assert sum(f.startswith("zero_pp_rank_") and f.endswith("optim_states.pt") for f in parts) == 2, parts
    resumed = os.path.join("runs", f"{stage}_resumed")
    shutil.copytree(straight, resumed)
    shutil.rmtree(os.path.join(resumed, "checkpoints", "step_4"))  # as if interrupted after step 2's checkpoint
    launch(in_toy_workdir, "grpo.py", argv + ["--resume_from", resumed], num_processes=2, config=config)

    assert_same_weights(final_weights(straight, 4), final_weights(resumed, 4), atol=0)
    assert [m["step"] for m in read_metrics(resumed)] == [1, 2, 3, 4]
    assert read_metrics(resumed)[-1]["reward/mean"] == read_metrics(straight)[-1]["reward/mean"]
    base, trained = load_file(os.path.join("runs", "toy", "model", "model.safetensors")), final_weights(straight, 4)
    assert all(trained[k].shape == v.shape for k, v in base.items())  # every tensor whole, none a shard
    # FSDP2's full state dict holds the tied lm_head as a tensor of its own, which save_pretrained then writes too
    assert set(trained) - set(base) <= {"lm_head.weight"}
    assert torch.equal(trained.get("lm_head.weight", trained["model.embed_tokens.weight"]),
                       trained["model.embed_tokens.weight"])
    assert any(not torch.equal(base[k], trained[k]) for k in base)

    out = os.path.join("runs", f"{stage}_eval")
    command = [sys.executable, "-m", "evals.run", "--model", os.path.join(straight, "checkpoints", "step_4", "model"),
               "--benchmarks", "toy", "--max_tokens", "6", "--engine", "hf", "--max_questions", "50", "--output", out]
    env = subprocess_env()
    done = subprocess.run(command, cwd=in_toy_workdir, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(os.path.join(out, "results.json")) as f:
        toy = json.load(f)["benchmarks"]["toy"]
    assert toy["num_questions"] == 50 and 0.0 < toy["avg@1"] <= 1.0  # the toy warm start answers some sums


CONFIGS = sorted(glob.glob(os.path.join(REPO, "configs", "accelerate", "*.yaml")))


@pytest.mark.parametrize("config", CONFIGS, ids=os.path.basename)
def test_every_accelerate_config_launches_two_processes(in_toy_workdir, config):
    """Each file in configs/accelerate/ as `accelerate launch --config_file` reads it, with conftest.launch's CPU
    overrides (2 processes, fp32): one RL step with a checkpoint, in the mode the file asks for."""
    with open(config) as f:
        kind = yaml.safe_load(f)["distributed_type"]
    name = os.path.basename(config)[: -len(".yaml")]
    report = os.path.join(in_toy_workdir, f"config_{name}.jsonl")
    if os.path.exists(report):
        os.remove(report)
    launch(in_toy_workdir, "grpo.py", SMALL + ["--run_name", f"config_{name}"], num_processes=2, config=config,
           env={"SHARDING_REPORT": report})
    reports = sharding_reports(report)
    expected = {"MULTI_GPU": "MULTI_CPU", "FSDP": "FSDP", "DEEPSPEED": "DEEPSPEED"}[kind]
    assert {r["rank"] for r in reports} == {0, 1}
    assert {r["distributed_type"] for r in reports} == {f"DistributedType.{expected}"}
    if kind == "FSDP":
        assert_sharded(reports)
    if name == "zero3":
        assert_sharded(reports, kind="ZeRO-3")
    assert os.path.exists(os.path.join("runs", f"config_{name}", "checkpoints", "step_1", "model", "model.safetensors"))
