"""What one step's sampling produces on a process: `Rollouts` (ragged lists, as the sampler returns
them) and `Batch` (the padded tensors the update reads). B rows, the G completions of a prompt in
consecutive rows (a group); a row is [left-padded prompt, P tokens | right-padded completion, T
tokens]."""

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class Rollouts:
    """One process's sampled groups: G consecutive rows per prompt, lists (ragged) and (B,)
    tensors."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    sampler_logp: list[list[float]]
    rewards: torch.Tensor  # (B,)
    per_func: dict[str, torch.Tensor]  # reward function -> (B,)
    truncated: torch.Tensor  # (B,) bool: cut at max_completion_length
    # 1 on the model's own tokens, 0 on tool output (multi-turn rollouts)
    action_mask: list[list[int]]


@dataclass
class Batch:
    """One step's rows on this process, as the update reads them."""

    input_ids: torch.Tensor  # (B, P+T) prompt | completion
    attention_mask: torch.Tensor  # (B, P+T) 1 on every prompt and completion token
    # (B, T) 1 on every completion token (EOS and tool output included)
    completion_tokens: torch.Tensor
    # (B, T) the tokens the loss sees: the model's own, in rows not removed from the loss
    mask: torch.Tensor
    sampler_logp: torch.Tensor  # (B, T) the sampler's log-probs of its tokens (0 on tool output)
    rewards: torch.Tensor  # (B,)
    truncated: torch.Tensor  # (B,) bool: cut at --max_completion_length
    per_func: dict[str, torch.Tensor]  # reward function -> (B,) its weighted-in reward
    # (B, T) the behaviour policy's: the weights that sampled the batch
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None  # (B, T) the frozen reference's; None without a KL term
    sampled_at: int = 0  # the step whose weights sampled it
    staleness: int = 0  # steps between those weights and the ones it trains (<= --rollout_lag)

    def to(self, device) -> "Batch":
        def move(x):
            return x.to(device) if torch.is_tensor(x) else x

        return replace(self, **{f.name: move(getattr(self, f.name)) for f in fields(self)
                                if f.name != "per_func"})

    def as_dict(self) -> dict:
        """Plain tensors and numbers, as a checkpoint saves them (torch.load(weights_only=True)
        reads them back)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def pad_rows(rows: list[list], value, left: bool = False) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor(
        [([value] * (width - len(r)) + r) if left else (r + [value] * (width - len(r)))
         for r in rows])
