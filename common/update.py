"""The policy update's plumbing, each rule named and written down where it is applied.

The scripts call their estimator once per micro-batch, but the estimator's loss is the whole optimizer batch's
(docs/estimators/conventions.md: full-batch semantics). Three rules make the micro-batched, multi-process update
equal to one call on the whole batch:
- `batch_stats` returns the script's `Stats`, a `BatchStats` dataclass (below) whose fields say what they hold:
  whole-batch totals, each summed over the processes by the `total` function the loop passes
  (the script's `total`: accelerate's `reduce`), and, for a few estimators, per-row values (fields declared with
  `BatchStats.per_row()`), which stay with their rows: a group never straddles processes, and `for_rows` cuts them
  to a micro-batch's rows;
- `compute_loss` then returns each micro-batch's share of the batch loss, and the script's loop scales it by the
  accumulation steps and the processes before `accelerator.backward`, undoing what accelerate does to a loss
  (divide by the former, average over the latter);
- one optimizer step per mini-batch: accelerate's `accumulate` says when (`sync_gradients`).
"""

import os
from dataclasses import dataclass, field, fields, replace

import torch


@dataclass
class BatchStats:
    """What an estimator's compute_loss needs from the whole optimizer batch. A script's `Stats(BatchStats)` names
    its fields: whole-batch totals, and fields declared with `BatchStats.per_row()`, which hold one value per row."""

    @staticmethod
    def per_row():
        """A field of a `Stats` dataclass holding (rows,) values of the mini-batch, cut to a micro-batch's rows:
        `log_weight: torch.Tensor = BatchStats.per_row()`."""
        return field(metadata={"per_row": True})

    def for_rows(self, rows: torch.Tensor):
        """The statistics of a micro-batch: the totals as they are, the per-row values of `rows` (positions within
        the mini-batch)."""
        cut = {f.name: getattr(self, f.name)[rows] for f in fields(self) if f.metadata.get("per_row")}
        return replace(self, **cut)

    def per_row_values(self) -> dict[str, torch.Tensor]:
        """The per-row fields by name (--dump_stats_steps saves them; e.g. SNIB's log-weights)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("per_row")}


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over the tokens the loss sees."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def minibatches(run) -> list[slice]:
    """This process's rows of each mini-batch (one optimizer step each); the whole batch when there is one."""
    return [slice(start, start + run.local_mini) for start in range(0, run.local_rows, run.local_mini)]


def microbatches(run, batch, mini: slice, whole_groups: bool = False) -> list[torch.Tensor]:
    """The rows of `mini` in groups of --micro_batch_size, of similar completion lengths (less padding);
    `whole_groups`: each micro-batch holds whole groups of G rows, in their order."""
    unit = run.args.num_generations if whole_groups else 1
    return length_buckets(batch.completion_tokens[mini], run.args.micro_batch_size, offset=mini.start, unit=unit)


def length_buckets(mask: torch.Tensor, size: int, offset: int = 0, unit: int = 1) -> list[torch.Tensor]:
    """Rows offset + i of `mask` (rows, T) in groups of `size`, longest completions first: each group's forward
    runs on its own longest row's columns (completion_logprobs), so rows of similar length together waste little
    padding. A micro-batch's gradient adds up the same whatever rows it holds (the loss normalisers are the
    optimizer batch's), so only the order of floating-point sums changes. `unit` > 1 (`size` a multiple of it)
    keeps consecutive runs of `unit` rows together and in order (a loss that needs whole groups in a micro-batch),
    sorted by each run's longest row."""
    longest = mask.sum(-1).view(-1, unit).amax(-1)  # (rows / unit,)
    units = torch.argsort(longest, descending=True, stable=True)  # (rows / unit,)
    order = (units[:, None] * unit + torch.arange(unit, device=mask.device)).flatten() + offset  # (rows,)
    return list(order.split(size))


def rows_of(x: torch.Tensor | None, rows) -> torch.Tensor | None:
    """x[rows], or None for an absent tensor (ref_logp without a KL term, tis_weights without --tis_cap)."""
    return None if x is None else x[rows]


def save_dumps(run, step: int, dumps: list) -> None:
    """--dump_stats_steps: the per-row statistics of each optimizer step of `step` (e.g. SNIB's log-weights), one
    file per process; estimators without per-row statistics write nothing."""
    per_row = [stats.per_row_values() for stats in dumps]
    if not any(per_row):
        return
    os.makedirs(os.path.join(run.run_dir, "stats"), exist_ok=True)
    name = f"step_{step + 1:06d}.rank{run.accelerator.process_index}.pt"
    cpu = [{k: v.cpu() for k, v in values.items()} for values in per_row]
    torch.save(cpu, os.path.join(run.run_dir, "stats", name))
