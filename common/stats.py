"""Whole-batch statistics of the update: what an estimator's loss needs from the whole optimizer batch when the
loop calls it once per micro-batch (docs/estimators/conventions.md: full-batch semantics).

A script's `batch_stats` returns its `Stats`, a `BatchStats` dataclass whose fields say what they hold: totals over
the optimizer batch, each summed over the processes by the `total` function the loop passes (`sum_over_processes`),
and, for a few estimators, per-row values (fields declared with `per_row()`), which stay with their rows: a group
never straddles processes, and `for_rows` cuts them to a micro-batch's rows.
"""

from dataclasses import dataclass, field, fields, replace

import torch


def sum_over_processes(accelerator):
    """A function that sums a tensor over every process (an all-reduce): whole-batch totals from each one's sums."""

    def total(x: torch.Tensor) -> torch.Tensor:
        return accelerator.reduce(x, "sum")

    return total


def this_process(x: torch.Tensor) -> torch.Tensor:
    """The `total` of one process alone (a test, a single CPU): its sums are the batch's."""
    return x


def per_row():
    """A field of a `Stats` dataclass holding (rows,) values of the mini-batch, cut to a micro-batch's rows."""
    return field(metadata={"per_row": True})


@dataclass
class BatchStats:
    """What an estimator's compute_loss needs from the whole optimizer batch. A script's `Stats(BatchStats)` names
    its fields: whole-batch totals, and fields declared with `per_row()`, which hold one value per row."""

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
