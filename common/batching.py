"""How a step's training batch is formed, around the sampling itself: DAPO's dynamic sampling and overlong
penalty (arXiv:2503.14476 sections 3.2 and 3.4), truncation masks, the sampler/trainer importance weights (TIS and
masked IS), and the rollout-lag queue. The spec is ESTIMATORS.md, "Options shared by all five"; none of this
changes an estimator's formulas, only which rows reach them and with which weights.
"""

import math
import os
from collections import deque
from dataclasses import dataclass, fields

import torch


@dataclass
class Rollouts:
    """One process's sampled groups: G consecutive rows per prompt, lists (ragged) and (B,) tensors."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampler_logp: list[list[float]]
    rewards: torch.Tensor  # (B,)
    per_func: dict[str, torch.Tensor]  # reward function -> (B,)
    truncated: torch.Tensor  # (B,) bool: cut at max_completion_length
    action_mask: list[list[int]]  # 1 on the model's own tokens, 0 on tool output (multi-turn rollouts)

    def groups(self, index: list[int], G: int) -> "Rollouts":
        """The rows of groups `index` (in that order)."""
        rows = [g * G + j for g in index for j in range(G)]
        pick = lambda x: [x[i] for i in rows] if isinstance(x, list) else x[rows]  # noqa: E731
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return Rollouts(**{k: {n: pick(x) for n, x in v.items()} if isinstance(v, dict) else pick(v)
                           for k, v in values.items()})

    @staticmethod
    def cat(parts: list["Rollouts"]) -> "Rollouts":
        join = lambda xs: sum(xs, []) if isinstance(xs[0], list) else torch.cat(xs)  # noqa: E731
        return Rollouts(**{f.name: ({k: join([getattr(p, f.name)[k] for p in parts]) for k in getattr(parts[0], f.name)}
                                    if f.name == "per_func" else join([getattr(p, f.name) for p in parts]))
                           for f in fields(Rollouts)})


def fill_batch(sample_round, num_groups: int, G: int, accelerator, max_rounds: int,
               metrics: dict) -> tuple[Rollouts, torch.Tensor]:
    """DAPO's dynamic sampling: drop the groups whose rewards are all equal (their advantages are 0: no signal) and
    sample more prompts, `sample_round(1)`, `sample_round(2)`, ..., until `num_groups` groups are kept; the batch is
    the first `num_groups` kept, in sampling order. Every process runs as many rounds as the one that needs most
    (generation can be collective: FSDP, ZeRO-3, tensor parallelism); after `max_rounds` extra rounds the slots left
    are filled with dropped groups whose rows leave the loss. Returns the batch and `removed` (B,), true on those rows.

    Each process keeps its own groups, so which prompts form the batch depends on the number of processes (as in
    verl's filter_groups); without --dynamic_sampling it does not."""
    kept, dropped, sampled = [], [], 0
    for r in range(max_rounds + 1):
        part = sample_round(r)
        spread = part.rewards.view(-1, G).std(dim=1) > 0  # (n,) groups with a reward signal
        kept += [part.groups([g], G) for g in spread.nonzero()[:, 0].tolist()]
        dropped += [part.groups([g], G) for g in (~spread).nonzero()[:, 0].tolist()]
        sampled += len(spread)
        short = torch.tensor(float(len(kept) < num_groups), device=accelerator.device)
        if accelerator.reduce(short, "max").item() == 0:
            break
    unfilled = max(num_groups - len(kept), 0)
    batch = Rollouts.cat(kept[:num_groups] + dropped[:unfilled])
    removed = torch.arange(num_groups * G) >= (num_groups - unfilled) * G  # (B,)
    totals = accelerator.reduce(torch.tensor([sampled, len(dropped), unfilled], device=accelerator.device), "sum")
    metrics.update({"dynamic/rounds": r + 1, "dynamic/prompts_sampled": totals[0].item(),
                    "dynamic/groups_dropped": totals[1].item(), "dynamic/unfilled_groups": totals[2].item()})
    return batch, removed


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13), a reward term: 0 up to max_length - buffer tokens, then falling
    linearly to -penalty at max_length (the sampler never exceeds it). lengths (B,) count completion tokens."""
    over = (lengths.float() - (max_length - buffer)).clamp(min=0)  # (B,)
    return -penalty * over / buffer  # (B,)


def importance_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, cap: float,
                       mode: str = "token", masked: bool = False) -> tuple[torch.Tensor, float]:
    """Sampler/trainer mismatch weights (B, T) for the policy term, constants (ESTIMATORS.md). log rho_t =
    old_logp_t - sampler_logp_t on valid tokens; "token": one weight per token, "sequence": rho_i = prod_t rho_t
    on every token of row i. Truncated IS (TIS): min(rho, cap); masked IS (MIS, `masked`): rho where rho <= cap,
    else 0. Returns the weights (0 at padding) and the fraction of tokens (sequence: rows) masked."""
    mask = mask.float()
    log_rho = (old_logp - sampler_logp) * mask  # (B, T)
    if mode == "sequence":
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(mask)  # (B, T)  log rho_i on every token of row i
    over = log_rho > math.log(cap)  # (B, T)
    weights = torch.exp(log_rho.clamp(max=math.log(cap))) * mask  # (B, T)  min(rho, cap)
    if masked:
        weights = weights * ~over  # (B, T)
    valid = mask > 0 if mode == "token" else mask.sum(-1) > 0  # tokens, or rows
    masked_frac = 0.0
    if masked and valid.any():
        masked_frac = (over if mode == "token" else over[:, 0])[valid].float().mean().item()
    return weights, masked_frac


class RolloutQueue:
    """--rollout_lag K: the batch trained at step s was sampled at step s-K, with the weights of that step, as in
    verl's one-step-off / fully async modes and prime-rl's async level. Colocated, sampling K steps ahead is a FIFO:
    `next(step, sample)` samples the batch of step + K with the current weights and returns the batch of `step`.
    At the start, the batches of steps 0..K are all sampled with the initial weights (step s < K trains with lag s).
    Each batch keeps its step's prompts and seeds, so a run with lag K sees the same data as one with lag 0; only
    the weights that sampled it differ. Each process queues its own rows and saves them in its checkpoint."""

    def __init__(self, lag: int):
        self.lag, self.batches = lag, deque()

    def next(self, step: int, sample, total_steps: int | None = None) -> dict:
        """The batch of `step`; first samples, with the current weights, what is missing up to step + K (never a
        step at or past `total_steps`: nothing would train on it)."""
        while len(self.batches) <= self.lag and (total_steps is None or step + len(self.batches) < total_steps):
            self.batches.append(sample(step + len(self.batches)))
        return self.batches.popleft()

    def save(self, state_dir: str, process_index: int) -> None:
        if self.batches:  # lag 0 queues nothing between steps
            torch.save(list(self.batches), os.path.join(state_dir, f"rollout_queue_{process_index}.pt"))

    def load(self, state_dir: str, process_index: int) -> None:
        path = os.path.join(state_dir, f"rollout_queue_{process_index}.pt")
        self.batches = deque(torch.load(path, weights_only=True) if os.path.exists(path) else [])
