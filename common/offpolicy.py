"""Off-policy machinery (docs/off-policy.md): the sampler/trainer importance weights (TIS and masked
IS). They change no estimator's formula, only how much each token counts (docs/estimators/
conventions.md says how they compose); the rollout-lag queue is common/sampling.py's RolloutQueue.
"""

import math

import torch


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
