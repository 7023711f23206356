"""DAPO's dynamic sampling and overlong penalty ("DAPO: An Open-Source LLM Reinforcement Learning
System at Scale", arXiv:2503.14476, sections 3.2 and 3.4): which groups reach the loss, and a reward
term for length. Imported by common/sampling.py only when --dynamic_sampling or --overlong_buffer is
set.
"""

from dataclasses import fields

import torch


def groups(rollouts, index: list[int], G: int):
    """The rows of groups `index` (in that order), a Rollouts (common/sampling.py) as `rollouts`
    is."""
    rows = [g * G + j for g in index for j in range(G)]

    def pick(x):
        return [x[i] for i in rows] if isinstance(x, list) else x[rows]

    values = {f.name: getattr(rollouts, f.name) for f in fields(rollouts)}
    return type(rollouts)(**{
        k: {n: pick(x) for n, x in v.items()} if isinstance(v, dict) else pick(v)
        for k, v in values.items()
    })


def cat(parts: list):
    """The rows of `parts` (Rollouts, common/sampling.py), one after another."""

    def join(xs):
        return sum(xs, []) if isinstance(xs[0], list) else torch.cat(xs)

    def joined(name: str):
        if name == "per_func":
            return {k: join([getattr(p, name)[k] for p in parts]) for k in getattr(parts[0], name)}
        return join([getattr(p, name) for p in parts])

    return type(parts[0])(**{f.name: joined(f.name) for f in fields(parts[0])})


def fill_batch(sample_round, num_groups: int, G: int, accelerator, max_rounds: int,
               metrics: dict) -> tuple[object, torch.Tensor]:
    """DAPO's dynamic sampling: drop the groups whose rewards are all equal (their advantages are 0:
    no signal) and sample more prompts, `sample_round(1)`, `sample_round(2)`, ..., until
    `num_groups` groups are kept; the batch is the first `num_groups` kept, in sampling order. Every
    process runs as many rounds as the one that needs most (generation can be collective: FSDP,
    ZeRO-3, tensor parallelism); after `max_rounds` extra rounds the slots left are filled with
    dropped groups whose rows leave the loss. Returns the batch and `removed` (B,), true on those
    rows.

    Each process keeps its own groups, so which prompts form the batch depends on the number of
    processes (as in verl's filter_groups); without --dynamic_sampling it does not."""
    kept = []
    dropped = []
    sampled = 0
    for r in range(max_rounds + 1):
        part = sample_round(r)
        spread = part.rewards.view(-1, G).std(dim=1) > 0  # (n,) groups with a reward signal
        kept += [groups(part, [g], G) for g in spread.nonzero()[:, 0].tolist()]
        dropped += [groups(part, [g], G) for g in (~spread).nonzero()[:, 0].tolist()]
        sampled += len(spread)
        short = torch.tensor(float(len(kept) < num_groups), device=accelerator.device)
        if accelerator.reduce(short, "max").item() == 0:
            break
    unfilled = max(num_groups - len(kept), 0)
    batch = cat(kept[:num_groups] + dropped[:unfilled])
    removed = torch.arange(num_groups * G) >= (num_groups - unfilled) * G  # (B,)
    totals = accelerator.reduce(
        torch.tensor([sampled, len(dropped), unfilled], device=accelerator.device), "sum")
    metrics.update(
        {"dynamic/rounds": r + 1, "dynamic/prompts_sampled": totals[0].item(),
         "dynamic/groups_dropped": totals[1].item(), "dynamic/unfilled_groups": totals[2].item()})
    return batch, removed


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer: int,
                     penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (eq. 13), a reward term: 0 up to max_length - buffer tokens,
    then falling linearly to -penalty at max_length (the sampler never exceeds it). lengths (B,)
    count completion tokens."""
    over = (lengths.float() - (max_length - buffer)).clamp(min=0)  # (B,)
    return -penalty * over / buffer  # (B,)
