"""Rollout engines: one interface, two implementations.

    engine.generate(model, prompt_ids, seeds, max_tokens=, temperature=, top_p=, stop=None)
        -> (completion_ids, sampler_logp)   one completion per prompt, EOS included if generated,
                                            and the sampler's log-prob of each sampled token
                                            (max_tokens: one budget, or one per prompt; stop:
                                            strings that end a completion, multiturn.py's)
    engine.push_weights(model)              after each optimizer step (a no-op for HFEngine)
    engine.wake_up() / engine.sleep()       around generation (free GPU memory while training)

`VLLMEngine` (common/engines/vllm_engine.py) is the fast path on GPUs; `HFEngine` uses transformers'
`generate` and runs anywhere. Both are reproducible per request: a completion depends only on its
seed, `sample_seed(seed, step, prompt_index, sample_index)`, never on the number of processes or on
how requests were batched."""

import contextlib
import importlib.util

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteriaList,
)

from common.logprobs import shared_prompt_cache
from common.models.placement import padding_safe_attention, sharded_parameters

# HFEngine: rows x (longest prompt + max_tokens) per `generate` call. Bounds the KV cache (Qwen3-4B
# in bf16: ~19 GB at 2**17 tokens); short sequences go in one call, which is what makes a CPU run
# fast.
GENERATE_BATCH_TOKENS = 2**17


def sample_seed(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed for one completion (an injective mix for indices below 2**20)."""
    mixed = ((seed * 1_048_573 + step) * 1_048_573 + prompt_index) * 1_048_573 + sample_index
    return mixed % (2**63 - 1)


def row_uniforms(seeds: list[int], tokens: int) -> torch.Tensor:
    """(rows, tokens) float64 uniforms in [0, 1): row r's t-th is the t-th draw of a generator
    seeded with seeds[r].

    Made once per `generate` call, on the host, so the draws are the same on any device and a row's
    are its own."""
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    return torch.stack([torch.rand(tokens, generator=g, dtype=torch.float64) for g in generators])


class SeededSampler(LogitsProcessor):
    """Temperature, top-p, then one inverse-CDF draw per row from that row's own uniforms.

    Token t of row r is the first token whose cumulative probability exceeds u[r, t] (row_uniforms),
    an exact sample from p. `generate` runs greedy on the scores returned (0 at the drawn token,
    -inf elsewhere), so each row's draws depend only on its seed: batching cannot change them. The
    work per token is a few whole-batch operations, whatever the number of rows. Also records the
    log-prob of each chosen token under the distribution it was drawn from, the trainer's definition
    of logp: softmax(logits / T), renormalised over the kept set when top_p < 1."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float, tokens: int,
                 device: torch.device | str = "cpu"):
        # (tokens, B): a token's row contiguous
        self.uniforms = row_uniforms(seeds, tokens).T.contiguous().to(device)
        self.temperature, self.top_p = temperature, top_p
        self.position = 0  # the index of the token being drawn
        self.last_logp = None  # (B, V) log-probs of the previous step, to look up its chosen token
        self.chosen_logp = []  # per step, (B,)

    def record(self, tokens: torch.Tensor) -> None:
        tokens = tokens[:, None].to(self.last_logp.device)  # (B, 1)
        self.chosen_logp.append(self.last_logp.gather(-1, tokens)[:, 0])  # (B,)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.last_logp is not None:
            self.record(input_ids[:, -1])
        logits = scores.float() / (self.temperature if self.temperature > 0 else 1.0)  # (B, V)
        self.last_logp = logp = torch.log_softmax(logits, dim=-1)  # (B, V)
        if self.temperature == 0:
            return logp  # greedy
        if self.top_p < 1.0:  # keep the smallest set of tokens whose probability reaches top_p
            sorted_logp, order = logp.sort(dim=-1, descending=True)
            drop = sorted_logp.exp().cumsum(-1) - sorted_logp.exp() >= self.top_p  # (B, V)
            logp = logp.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
            # (B, V) the kept set's distribution
            self.last_logp = logp = torch.log_softmax(logp, dim=-1)
        cdf = logp.double().exp().cumsum(dim=-1)  # (B, V)
        # Divided by its last entry, the cdf ends at exactly 1 and stays non-decreasing, so a
        # uniform in [0, 1) always finds a first entry above it, and that entry is never a token of
        # zero probability (dropped by top_p, or below float range), whose entry equals the one
        # before it.
        cdf = cdf / cdf[:, -1:]  # (B, V)
        u = self.uniforms[self.position, :, None]  # (B, 1)
        self.position += 1
        token = torch.searchsorted(cdf, u, right=True)  # (B, 1) the first entry above u
        return torch.full_like(scores, float("-inf")).scatter_(-1, token, 0.0)


class HFEngine:
    """transformers `generate` on the training model itself, so new weights need no push."""

    def __init__(self, tokenizer, accelerator, share_prompts: bool = True,
                 sharded: bool | None = None):
        self.tokenizer, self.accelerator = tokenizer, accelerator
        # the rows of a prompt share one prefill of it (--share_prompts)
        self.share_prompts = share_prompts
        # FSDP or ZeRO-3 (common.models.placement.sharded_parameters): generate is then a
        # collective; None: asked of the accelerator on first use
        self.is_sharded = sharded
        # left-padded prompts: no NaN from cuDNN's attention (common.models.placement)
        padding_safe_attention()

    @torch.no_grad()
    def generate(self, model, prompt_ids: list[list[int]], seeds: list[int], *,
                 max_tokens: int | list[int], temperature: float, top_p: float,
                 batch_size: int | None = None,
                 stop: list[str] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """`batch_size` rows per `generate` call (default: as many as fit GENERATE_BATCH_TOKENS).
        `max_tokens`: one budget, or one per prompt; `stop`: strings that end a completion
        (StopRows). A row's tokens do not depend on the other rows' budgets or stops: its sampler
        draws are its own (SeededSampler)."""
        if len(seeds) != len(prompt_ids):
            raise ValueError(f"one seed per prompt: got {len(seeds)} seeds for {len(prompt_ids)} "
                             "prompts")
        per_row = not isinstance(max_tokens, int)
        budgets = list(max_tokens) if per_row else [max_tokens] * len(prompt_ids)
        if len(budgets) != len(prompt_ids):
            raise ValueError(f"one max_tokens per prompt: got {len(budgets)} for {len(prompt_ids)} "
                             "prompts")
        max_tokens = max(budgets, default=0)
        if batch_size is None:
            width = max(map(len, prompt_ids), default=0) + max_tokens
            width = torch.tensor(width, device=self.accelerator.device)
            if self.sharded():  # every process must make the same number of generate calls
                width = self.accelerator.reduce(width, "max")
            batch_size = max(1, GENERATE_BATCH_TOKENS // int(width))
        unwrapped = self.accelerator.unwrap_model(model)
        was_training = unwrapped.training
        unwrapped.eval()
        eos, pad = self.tokenizer.eos_token_id, self.tokenizer.pad_token_id
        config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=eos,
                                  pad_token_id=pad, bos_token_id=None)
        completions, logps = [], []
        gather = contextlib.nullcontext()
        if self.sharded():  # ZeRO-3: the full weights, gathered once for the whole generation
            from common.models.sharding import gathered_for_generation

            gather = gathered_for_generation(self.accelerator, model)
        with gather:
            for i in range(0, len(prompt_ids), batch_size):
                chunk = prompt_ids[i : i + batch_size]
                width = max(len(p) for p in chunk)
                # (b, P), left-padded
                input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in chunk])
                attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p)
                                               for p in chunk])
                device = self.accelerator.device
                input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
                rows = slice(i, i + batch_size)
                sampler = SeededSampler(seeds[rows], temperature, top_p, max_tokens, device)
                processors, criteria = LogitsProcessorList([sampler]), StoppingCriteriaList()
                # tool rollouts (common/engines/multiturn.py): a budget per row, stop strings
                if per_row or stop:
                    from common.engines.stopping import StopRows

                    criteria.append(StopRows(self.tokenizer, stop or [], budgets[rows], width))
                # each distinct prompt, but its last token, prefilled once for all its rows (vLLM:
                # prefix caching)
                cache = None
                if self.share_prompts and not self.sharded():
                    cache = shared_prompt_cache(unwrapped, input_ids, attention_mask, width - 1)
                out = unwrapped.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    past_key_values=cache,
                    generation_config=config,
                    logits_processor=processors,
                    stopping_criteria=criteria,
                    synced_gpus=self.sharded(),
                )[:, width:]  # (b, T)
                sampler.record(out[:, -1])
                chosen = torch.stack(sampler.chosen_logp, dim=1).cpu()  # (b, T)
                stopped = criteria[0].lengths if criteria else [None] * len(chunk)
                for row, lp, length in zip(out.tolist(), chosen.tolist(), stopped):
                    # a stopped row is padded afterwards (with EOS where pad is EOS)
                    row = row[:length]
                    # keep EOS, drop what follows
                    n = row.index(eos) + 1 if eos in row else len(row)
                    completions.append(row[:n])
                    logps.append(lp[:n])
        unwrapped.train(was_training)
        return completions, logps

    def sharded(self) -> bool:
        if self.is_sharded is None:
            self.is_sharded = sharded_parameters(self.accelerator)
        return self.is_sharded

    def collective(self) -> bool:
        """Whether every process must make each generate call, with as many rows (FSDP, ZeRO-3:
        synced_gpus)."""
        return self.sharded()

    def push_weights(self, model) -> None:
        """Nothing to push: the training model itself generates (nor anything to wake, free or shut
        down)."""

    def wake_up(self) -> None: ...
    def sleep(self) -> None: ...
    def shutdown(self) -> None: ...


def single_turn(engine, model, tokenizer, prompt_ids: list[list[int]], seeds: list[int], *,
                max_tokens: int, temperature: float,
                top_p: float) -> tuple[list, list, list, list]:
    """One generate call: (completion ids, sampler log-probs, action mask, finish) per row; every
    token is the model's and `finish` is "eos" or "length" (the token budget)."""
    ids, logps = engine.generate(model, prompt_ids, seeds, max_tokens=max_tokens,
                                 temperature=temperature, top_p=top_p)
    finish = ["eos" if c and c[-1] == tokenizer.eos_token_id else "length" for c in ids]
    return ids, logps, [[1] * len(c) for c in ids], finish


def vllm_installed() -> bool:
    """vLLM can be imported and has a device (checked without loading common/engines/vllm_engine.py
    when it is absent)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    from common.engines.vllm_engine import vllm_available

    return vllm_available()
