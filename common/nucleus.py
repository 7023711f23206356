"""The distribution sampled at top_p < 1, for common/logprobs.py (imported only where --top_p < 1).

The sampler (common/engines/rollout.py SeededSampler; vLLM alike) keeps, at each position, the
smallest set of tokens, by descending probability under softmax(z), z = logits / T, whose
probability reaches top_p, and draws from softmax(z) renormalised over that set. The trainer's
policy is that distribution: log p_y = z_y - logsumexp(z over the kept set). The set is a function
of z that is piecewise constant (it changes only where two tokens swap places or the cumulative sum
crosses top_p, a set of measure zero), so the gradient is that of the log-sum-exp over the set:
d log p_y / dz = onehot(y) - p, with p renormalised over the set and 0 outside it. Recomputing the
set from the trainer's own logits, as here, gives that gradient exactly; nothing of the sampler's
is needed. The entropy is that distribution's too, -sum over the set of p log p, with its gradient
-p (log p + H) on the set and 0 outside it.
"""

import torch

# The kept set is looked for among the NUCLEUS_TOPK most probable tokens first (a partial sort): a
# model's nucleus at top_p 0.9 is mostly far smaller; a position whose set is larger is sorted
# whole.
NUCLEUS_TOPK = 1024


def nucleus_floor(log_p: torch.Tensor, top_p: float) -> torch.Tensor:
    """(...,) the least log-prob kept by sampling at `top_p`, of log_p (..., V) = log softmax(z).

    The kept set is the smallest set of tokens, by descending probability, whose probability reaches
    top_p, tested as SeededSampler (common/engines/rollout.py) tests it. {v : log_p_v >= floor} is
    that set (with any token tied with its least, where the sampler's sort would pick one of them).
    Looked for among each position's NUCLEUS_TOPK most probable tokens (a sort of those alone); the
    positions whose set is larger are sorted whole."""
    k = min(NUCLEUS_TOPK, log_p.shape[-1])
    floor, complete = sorted_floor(log_p.topk(k, dim=-1).values, top_p)  # (...,) each
    if k < log_p.shape[-1] and not complete.all():
        rest = ~complete  # (...,) positions whose kept set may hold more than k tokens
        floor[rest] = sorted_floor(log_p[rest].sort(dim=-1, descending=True).values, top_p)[0]
    return floor


def sorted_floor(sorted_log_p: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(floor, complete), (...,) each, from the most probable tokens' log-probs in descending order
    (..., k): the least kept log-prob among them, and whether the kept set ends before the k-th
    (the k-th is dropped: so is every token after it)."""
    sorted_p = sorted_log_p.exp()  # (..., k)
    drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # (..., k) the mass before it reaches top_p
    return sorted_log_p.masked_fill(drop, float("inf")).amin(-1), drop[..., -1]


def nucleus_forward(log_p, targets, top_p: float, nucleus: torch.Tensor):
    """(log-prob of `targets`, entropy), (...,) each, under the kept set's distribution.

    From log_p (..., V) of the full softmax, which becomes the kept set's log p (meaningless outside
    the set, where p is 0). The target is always kept: the sampler drew it from its own kept set,
    and where the trainer's logits (other kernels, other shapes) put it just past the floor, it is
    kept rather than given log-prob -inf. Writes into `nucleus` (2, ...) the floor and the log of
    the kept probability, which the backward needs to find the same set again."""
    target_log_p = log_p.gather(-1, targets[..., None])[..., 0]  # (...,)
    floor = nucleus_floor(log_p, top_p)  # (...,)
    dropped = (log_p < floor[..., None]).scatter_(-1, targets[..., None], False)  # (..., V)
    kept_log_p = log_p.masked_fill(dropped, float("-inf"))  # (..., V)
    mass = torch.logsumexp(kept_log_p, dim=-1)  # (...,) log of the kept probability
    nucleus[0], nucleus[1] = floor, mass
    log_p.sub_(mass[..., None])  # (..., V)
    p = log_p.exp().masked_fill_(dropped, 0)  # (..., V)
    return target_log_p - mass, -(p.mul_(log_p)).sum(-1)


def nucleus_backward(log_p: torch.Tensor, targets: torch.Tensor,
                     nucleus: torch.Tensor) -> torch.Tensor:
    """p (..., V) of the kept set's distribution, 0 outside it, from the full softmax's log_p
    (..., V) recomputed as the forward computed it (so the same set); log_p becomes the kept set's
    log p."""
    dropped = (log_p < nucleus[0][..., None]).scatter_(-1, targets[..., None], False)  # (..., V)
    log_p.sub_(nucleus[1][..., None])
    return log_p.exp().masked_fill_(dropped, 0)
