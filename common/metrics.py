"""A step's metrics: timings, means over micro-batches and processes, the batch's rewards and
lengths, the sampler/trainer log-prob gap (and the check that stops a run whose sampler does not run
the trainer's weights), peak memory. docs/metrics.md says what each one means."""

import contextlib
import os
import sys
import time

import torch
from accelerate.utils import gather_object


@contextlib.contextmanager
def timed(metrics: dict, key: str):
    """Adds the seconds the block takes to metrics[key] (a step may sample several batches:
    --rollout_lag)."""
    start = time.time()
    yield
    metrics[key] = metrics.get(key, 0.0) + time.time() - start


def mean_over_processes(step_metrics: list[dict], accelerator) -> dict:
    """Each key's mean over this process's micro-batches, then over the processes that logged it
    (one gather: keys may differ by process)."""
    local = {key: sum(m[key].item() for m in step_metrics if key in m)
                  / sum(key in m for m in step_metrics)
             for key in {key for m in step_metrics for key in m}}
    per_process = gather_object([local])
    return {key: sum(p[key] for p in per_process if key in p) / sum(key in p for p in per_process)
            for key in sorted({key for p in per_process for key in p})}


def logp_gap(sampler_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """rollout/logp_gap_*: |sampler - trainer| log-prob of the same tokens at the same weights, over
    valid tokens."""
    gap = (sampler_logp - old_logp).abs() * mask  # (B, T)
    return {"rollout/logp_gap_mean": (gap.sum() / mask.sum().clamp(min=1)).item(),
            "rollout/logp_gap_max": gap.max().item()}


def check_weight_sync(logp_gap_mean: float, max_gap: float, step: int) -> None:
    """Stop the run when the sampler's log-probs of its own tokens stray from the trainer's: the
    rollout engine is not running the weights the trainer just updated (a push that failed silently
    or reached only some layers, as TRL #5312 shipped), and every later step would train on a
    policy's samples it does not know."""
    # A NaN gap is no failed push: stop_if_nonfinite names it.
    if max_gap > 0 and logp_gap_mean > max_gap:
        raise SystemExit(f"error: step {step}: rollout/logp_gap_mean = {logp_gap_mean:.4g} > "
                         f"--max_logp_gap {max_gap}: the rollout engine's log-probs are not the "
                         f"trainer's, so its weights are not the trainer's (a weight push that did "
                         f"not take effect?). Checkpoints written before this step are intact. If "
                         f"the gap is expected (e.g. an fp8 sampler), raise --max_logp_gap, or set "
                         f"it to 0 to turn the check off.")


def batch_metrics(batch, G: int, accelerator) -> dict:
    """reward/*, completion/* of the trained batch, over all processes."""
    lengths = batch.completion_tokens.sum(-1).float()  # (B,)
    gathered = accelerator.gather_for_metrics({
        "reward": batch.rewards, "length": lengths, "truncated": batch.truncated.float(),
        "removed": (batch.mask.sum(-1) == 0).float(),
        "zero_std": (batch.rewards.view(-1, G).std(dim=1) == 0).float(),
        **{f"reward/{name}": r.to(accelerator.device) for name, r in batch.per_func.items()}})
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
    for name in batch.per_func:  # over the samples each function applied to (None: NaN, left out)
        values = gathered[f"reward/{name}"]
        values = values[~values.isnan()]
        metrics[f"reward/{name}/mean"] = values.mean().item()
        metrics[f"reward/{name}/std"] = values.std().item()
    return metrics


def mean_grad_norm(grad_norms: list) -> float:
    """Mean of what accelerator.clip_grad_norm_ returned: tensors, but under DeepSpeed the engine's
    global norm, a float (None until the engine has computed one: NaN then)."""
    return torch.tensor([float("nan") if g is None else float(g) for g in grad_norms]).mean().item()


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process so far: allocated GPU memory on CUDA, else the resident set
    size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def warn(message: str) -> None:
    """One line on stderr from the first process of each machine (the others would repeat it)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"warning: {message}", file=sys.stderr, flush=True)
