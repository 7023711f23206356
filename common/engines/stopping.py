"""Stop criteria of transformers' `generate` for tool rollouts (common/engines/multiturn.py): each
row at its own token budget or at a stop string, as vLLM stops. Imported by rollout.HFEngine only
when a call passes either."""

import torch
from transformers import StoppingCriteria


class StopRows(StoppingCriteria):
    """Per row: stop at its own token budget, or after the token that completes one of the `stop`
    strings in the completion's text (as vLLM's stop strings: the prompt's text is not searched, and
    a string that ends inside a token keeps that whole token). Records where each row stopped, since
    `generate` pads a stopped row afterwards.

    Each step decodes only the last len(longest stop string) + STOP_WINDOW_SLACK tokens of each row:
    a string completed by this step's token lies within them unless that many tokens decode to
    nothing (special tokens)."""

    STOP_WINDOW_SLACK = 16

    def __init__(self, tokenizer, stop: list[str], budgets: list[int], prompt_width: int):
        self.tokenizer = tokenizer
        self.stop = stop
        self.budgets = budgets
        self.width = prompt_width
        self.window = max(map(len, stop), default=0) + self.STOP_WINDOW_SLACK
        self.lengths: list[int | None] = [None] * len(budgets)  # tokens kept per row, once stopped

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        n = input_ids.shape[1] - self.width  # tokens generated so far
        for row, tail in enumerate(input_ids[:, -min(n, self.window):].tolist()):
            if self.lengths[row] is None and (n >= self.budgets[row] or self.completes_stop(tail)):
                self.lengths[row] = n
        return torch.tensor([length is not None for length in self.lengths],
                            device=input_ids.device)

    def completes_stop(self, tail: list[int]) -> bool:
        text = self.tokenizer.decode(tail, skip_special_tokens=True) if self.stop else ""
        return any(s in text for s in self.stop)
