"""How a step's training batch is formed, around the sampling itself: the sampled rows (`Rollouts`), the
sampler/trainer importance weights (TIS and masked IS) and the rollout-lag queue; DAPO's dynamic sampling and
overlong penalty are common/dapo.py. docs/estimators/conventions.md says how they compose; none of this
changes an estimator's formulas, only which rows reach them and with which weights.
"""

import math
import os
from collections import deque
from dataclasses import dataclass

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


def importance_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, cap: float,
                       mode: str = "token", masked: bool = False) -> tuple[torch.Tensor, float]:
    """Sampler/trainer mismatch weights (B, T) for the policy term, constants (docs/off-policy.md). log rho_t =
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
            self.batches.append({**sample(step + len(self.batches)), "sampled_at": step})
        batch = self.batches.popleft()  # sampled K steps ago, or fewer at the start (rollout/staleness)
        return {**batch, "staleness": step - batch.get("sampled_at", step - self.lag)}

    def save(self, state_dir: str, process_index: int) -> None:
        if self.batches:  # lag 0 queues nothing between steps
            torch.save(list(self.batches), os.path.join(state_dir, f"rollout_queue_{process_index}.pt"))

    def load(self, state_dir: str, process_index: int) -> None:
        path = os.path.join(state_dir, f"rollout_queue_{process_index}.pt")
        self.batches = deque(torch.load(path, weights_only=True) if os.path.exists(path) else [])
