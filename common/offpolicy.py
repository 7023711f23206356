"""Off-policy machinery (docs/off-policy.md): the sampler/trainer importance weights (TIS and masked
IS) and the rollout-lag queue. Neither changes an estimator's formulas, only which weights sampled
the rows that reach them and how much each token counts (docs/estimators/conventions.md says how
they compose).
"""

import math
import os
from collections import deque

import torch

from common.batch import Batch


def importance_weights(old_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor,
                       cap: float, mode: str = "token", masked: bool = False,
                       floor: float = 0.0) -> tuple[torch.Tensor, float]:
    """Sampler/trainer mismatch weights (B, T) for the policy term, constants (docs/off-policy.md).
    log rho_t = old_logp_t - sampler_logp_t on valid tokens; "token": one weight per token,
    "sequence": rho_i = prod_t rho_t on every token of row i. Truncated IS (TIS): min(rho, cap);
    masked IS (MIS, `masked`): rho where floor <= rho <= cap, else 0 (IcePop, arXiv:2510.18855:
    floor alpha, cap beta: --mis --tis_cap 5 --tis_floor 0.5). Returns the weights (0 at padding)
    and the fraction of tokens (sequence: rows) masked."""
    mask = mask.float()
    log_rho = (old_logp - sampler_logp) * mask  # (B, T)
    if mode == "sequence":
        # (B, T)  log rho_i on every token of row i
        log_rho = log_rho.sum(-1, keepdim=True).expand_as(mask)
    outside = log_rho > math.log(cap)  # (B, T)  above the cap
    if masked and floor > 0:
        outside = outside | (log_rho < math.log(floor))  # (B, T)  IcePop: or below the floor
    weights = torch.exp(log_rho.clamp(max=math.log(cap))) * mask  # (B, T)  min(rho, cap)
    if masked:
        weights = weights * ~outside  # (B, T)
    valid = mask > 0 if mode == "token" else mask.sum(-1) > 0  # tokens, or rows
    masked_frac = 0.0
    if masked and valid.any():
        masked_frac = (outside if mode == "token" else outside[:, 0])[valid].float().mean().item()
    return weights, masked_frac


class RolloutQueue:
    """--rollout_lag K: the batch trained at step s was sampled at step s-K, with the weights of
    that step, as in verl's one-step-off / fully async modes and prime-rl's async level. Colocated,
    sampling K steps ahead is a FIFO: at step s the loop samples the batch of step s + K with the
    current weights (`steps_to_sample`, `put`), then trains the batch of step s (`take`). At the
    start, the batches of steps 0..K are all sampled with the initial weights (step s < K trains
    with lag s). Each batch keeps its step's prompts and seeds, so a run with lag K sees the same
    data as one with lag 0; only the weights that sampled it differ. Each process queues its own
    rows and saves them in its checkpoint."""

    def __init__(self, lag: int):
        self.lag = lag
        self.batches = deque()

    def steps_to_sample(self, step: int, total_steps: int) -> list[int]:
        """The steps whose batches are sampled now, before step `step` trains: `step` itself at lag
        0; at lag K the step K ahead (at the start, steps 0..K); never a step at or past
        `total_steps` (nothing would train it)."""
        return list(range(step + len(self.batches), min(step + self.lag, total_steps - 1) + 1))

    def put(self, batch: Batch, sampled_at: int) -> None:
        """Queue the batch of the next step in line, sampled by the weights of step `sampled_at`."""
        batch.sampled_at = sampled_at
        self.batches.append(batch)

    def take(self, step: int) -> Batch:
        """The batch of `step`: sampled K steps ago, or fewer at the start (rollout/staleness)."""
        batch = self.batches.popleft()
        batch.staleness = step - batch.sampled_at
        return batch

    def save(self, state_dir: str, process_index: int) -> None:
        if self.batches:  # lag 0 queues nothing between steps
            path = os.path.join(state_dir, f"rollout_queue_{process_index}.pt")
            torch.save([b.as_dict() for b in self.batches], path)

    def load(self, state_dir: str, process_index: int) -> None:
        path = os.path.join(state_dir, f"rollout_queue_{process_index}.pt")
        saved = torch.load(path, weights_only=True) if os.path.exists(path) else []
        self.batches = deque(Batch(**b) for b in saved)
