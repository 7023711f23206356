"""Process and device plumbing shared by the algorithm scripts: placement (prepare_policy, prepare_reference), the
prompts of a step, the weight-sync canary, per-step metrics. Arguments are common/args.py's, checkpoints and the
metrics log common/checkpoints.py's, log-probs common/logprobs.py's.

Nothing here touches advantages, ratios, clipping, KL or loss aggregation: those live in the scripts.
"""

import contextlib
import importlib.util
import logging
import os
import sys
import time

import torch
from accelerate.utils import gather_object

# accelerate's unwrap_model imports deepspeed, whose accelerator detection then warns on every run without a GPU:
# "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." Here the CPU is
# the plan; any other DeepSpeed message still prints.
logging.getLogger("DeepSpeed").addFilter(lambda record: "Setting accelerator to CPU" not in record.getMessage())
TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}


def warn(message: str) -> None:
    """One line on stderr from the first process of each machine (the others would repeat it)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"warning: {message}", file=sys.stderr, flush=True)


def on_cpu() -> bool:
    """Whether this run trains on the CPU (no CUDA device, or `accelerate launch --cpu`). accelerate 1.15 joins the
    processes of a torchrun launch into one gloo group only when its state is created with cpu=True (state.py
    _prepare_backend); README, "Several CPU processes", says how to launch them."""
    return os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not torch.cuda.is_available()


def vllm_installed() -> bool:
    """vLLM can be imported and has a device (checked without loading common/vllm_engine.py when it is absent)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    from common.vllm_engine import vllm_available

    return vllm_available()


def check_weight_sync(logp_gap_mean: float, max_gap: float, step: int) -> None:
    """Stop the run when the sampler's log-probs of its own tokens stray from the trainer's: the rollout engine is
    not running the weights the trainer just updated (a push that failed silently or reached only some layers, as
    TRL #5312 shipped), and every later step would train on a policy's samples it does not know."""
    if max_gap > 0 and not logp_gap_mean <= max_gap:  # not <=: a NaN gap stops too
        raise SystemExit(
            f"error: step {step}: rollout/logp_gap_mean = {logp_gap_mean:.4g} > --max_logp_gap {max_gap}: the rollout "
            f"engine's log-probs are not the trainer's, so its weights are not the trainer's (a weight push that did "
            f"not take effect?). Checkpoints written before this step are intact. If the gap is expected (e.g. an "
            f"fp8 sampler), raise --max_logp_gap, or set it to 0 to turn the check off.")


def sharded_parameters(accelerator) -> bool:
    """FSDP and DeepSpeed ZeRO-3 shard the parameters: every forward is then a collective, and every process must
    run the same number of them (no data-dependent extra forward, such as a shared prompt prefix's)."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    return kind == DistributedType.FSDP or (kind == DistributedType.DEEPSPEED
                                            and accelerator.state.deepspeed_plugin.zero_stage == 3)


def mean_grad_norm(grad_norms: list) -> float:
    """Mean of what accelerator.clip_grad_norm_ returned: tensors, but under DeepSpeed the engine's global norm, a
    float (None until the engine has computed one: NaN then)."""
    return torch.tensor([float("nan") if g is None else float(g) for g in grad_norms]).mean().item()


def prepare_policy(accelerator, micro_batch_size: int, max_grad_norm: float, model, optimizer, scheduler):
    """accelerator.prepare; under DeepSpeed, after giving its config the micro-batch size and --max_grad_norm
    (common/sharding.py)."""
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        from common.sharding import configure_deepspeed

        configure_deepspeed(accelerator.state.deepspeed_plugin.deepspeed_config, micro_batch_size, max_grad_norm)
    return accelerator.prepare(model, optimizer, scheduler)


def prepare_reference(accelerator, ref_model):
    """The frozen reference model, placed as the policy is: sharded like it under FSDP2 and ZeRO-3
    (common/sharding.py), else on every process."""
    from accelerate.utils import DistributedType

    if getattr(accelerator, "is_fsdp2", False) or accelerator.distributed_type == DistributedType.DEEPSPEED:
        from common.sharding import prepare_sharded_reference

        return prepare_sharded_reference(accelerator, ref_model)
    return accelerator.prepare_model(ref_model, evaluation_mode=True)


def step_prompts(step: int, batch_size: int, num_generations: int, mini_batch_size: int, num_processes: int,
                 process_index: int, dataset_size: int, seed: int) -> tuple[list[int], list[int]]:
    """This process's prompts at `step`: (their indices within the step's global batch, their dataset rows).

    The step's N prompts are consecutive entries of a seeded per-epoch permutation of the dataset.
    Mini-batch k is prompts [k*Nm, (k+1)*Nm) of the step and each process takes a contiguous 1/P of
    every mini-batch, so the global batch, and every optimizer step's share of it, does not depend on P.
    """
    N, Nm = batch_size // num_generations, (mini_batch_size or batch_size) // num_generations
    positions = torch.arange(N).view(N // Nm, num_processes, Nm // num_processes)[:, process_index].flatten()
    stream = step * N + positions  # (n,) positions in the endless stream of prompts
    epochs = stream // dataset_size
    perms = {e: torch.randperm(dataset_size, generator=torch.Generator().manual_seed(seed + e))
             for e in set(epochs.tolist())}
    rows = [int(perms[int(e)][o]) for e, o in zip(epochs, stream % dataset_size)]
    return positions.tolist(), rows


@contextlib.contextmanager
def timed(metrics: dict, key: str):
    """Adds the seconds the block takes to metrics[key] (a step may sample several batches: --rollout_lag)."""
    start = time.time()
    yield
    metrics[key] = metrics.get(key, 0.0) + time.time() - start


def mean_over_processes(step_metrics: list[dict], accelerator) -> dict:
    """Each key's mean over this process's micro-batches, then over the processes that logged it (one gather: keys
    may differ by process)."""
    local = {key: sum(m[key].item() for m in step_metrics if key in m) / sum(key in m for m in step_metrics)
             for key in {key for m in step_metrics for key in m}}
    per_process = gather_object([local])
    return {key: sum(p[key] for p in per_process if key in p) / sum(key in p for p in per_process)
            for key in sorted({key for p in per_process for key in p})}


def logp_gap(sampler_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """rollout/logp_gap_*: |sampler - trainer| log-prob of the same tokens at the same weights, over valid tokens."""
    gap = (sampler_logp - old_logp).abs() * mask  # (B, T)
    return {"rollout/logp_gap_mean": (gap.sum() / mask.sum().clamp(min=1)).item(),
            "rollout/logp_gap_max": gap.max().item()}


def batch_metrics(batch: dict, G: int, accelerator) -> dict:
    """reward/*, completion/* of the trained batch, over all processes."""
    lengths = batch["completion_tokens"].sum(-1).float()  # (B,)
    gathered = accelerator.gather_for_metrics({
        "reward": batch["rewards"], "length": lengths, "truncated": batch["truncated"].float(),
        "removed": (batch["mask"].sum(-1) == 0).float(),
        "zero_std": (batch["rewards"].view(-1, G).std(dim=1) == 0).float(),
        **{f"reward/{name}": r.to(accelerator.device) for name, r in batch["per_func"].items()}})
    metrics = {
        "reward/mean": gathered["reward"].mean().item(),
        "reward/std": gathered["reward"].std().item(),
        "reward/frac_zero_std_groups": gathered["zero_std"].mean().item(),
        "completion/length_mean": gathered["length"].mean().item(),
        "completion/length_max": gathered["length"].max().item(),
        "completion/truncated_frac": gathered["truncated"].mean().item(),
        "completion/removed_frac": gathered["removed"].mean().item(),
        "completion/tokens": gathered["length"].sum().item(),
    }
    for name in batch["per_func"]:
        metrics[f"reward/{name}/mean"] = gathered[f"reward/{name}"].mean().item()
        metrics[f"reward/{name}/std"] = gathered[f"reward/{name}"].std().item()
    return metrics


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process so far: allocated GPU memory on CUDA, else the resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def pad_rows(rows: list[list], value, left: bool = False) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([([value] * (width - len(r)) + r) if left else (r + [value] * (width - len(r))) for r in rows])
