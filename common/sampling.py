"""One step's batch: its rollouts and their rewards (`sample_batch`), the log-probs of the weights
that sampled them (`old_and_reference_logprobs`), and its cut into mini- and micro-batches for the
update, with the whole batch's statistics (`minibatches`, `microbatches`, `BatchStats`).

The loop samples at --rollout_lag 0 right before the step trains the batch, at lag K K steps
earlier, with the weights of then. The advantages depend on the rewards only; the scripts compute
them where the step trains the batch.

The scripts call their estimator once per micro-batch, but the estimator's loss is the whole
optimizer batch's (docs/estimators/conventions.md: full-batch semantics). Three rules make the
micro-batched, multi-process update equal to one call on the whole batch:
- `batch_stats` returns the script's `Stats`, a `BatchStats` dataclass (below) whose fields say
  what they hold: whole-batch totals, each summed over the processes by the `total` function the
  loop passes (the script's `total`: accelerate's `reduce`), and, for a few estimators, per-row
  values (fields declared with `BatchStats.per_row()`), which stay with their rows: a group never
  straddles processes, and `for_rows` cuts them to a micro-batch's rows;
- `compute_loss` then returns each micro-batch's share of the batch loss, and the script's loop
  scales it by the accumulation steps and the processes before `accelerator.backward`, undoing
  what accelerate does to a loss (divide by the former, average over the latter);
- one optimizer step per mini-batch: accelerate's `accumulate` says when (`sync_gradients`).
"""

import os
import time
from collections import deque
from dataclasses import dataclass, field, fields, replace

import torch

from common.engines.rollout import sample_seed, single_turn
from common.logprobs import completion_logprobs
from common.tasks.rewards import RewardError, compute_rewards


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


def sample_batch(run, index: int, metrics: dict) -> Batch:
    """The rollouts of step `index` on this process and their rewards, as tensors (old_logp and
    ref_logp not yet set). `mask` marks the tokens the loss sees: the model's own (not tool output),
    in rows not removed (--mask_truncated; groups that --dynamic_sampling could not fill)."""
    args, G, local_rows = run.args, run.args.num_generations, run.local_rows
    # DAPO: more prompts until the batch holds local_rows // G groups with mixed rewards
    if args.dynamic_sampling:
        from common.dapo import fill_batch

        rollouts, removed = fill_batch(
            lambda r: sample_round(run, index, r, metrics), local_rows // G, G,
            run.accelerator, args.max_refill_rounds, metrics,
        )
    else:
        rollouts = sample_round(run, index, 0, metrics)
        removed = torch.zeros(local_rows, dtype=torch.bool)
    removed |= rollouts.truncated & args.mask_truncated  # (B,)
    return to_tensors(rollouts, removed, run.tokenizer.pad_token_id).to(run.accelerator.device)


def sample_round(run, index: int, r: int, metrics: dict) -> Rollouts:
    """G completions for each of this process's prompts of step `index`, and their rewards (whole
    groups per process, so rewards need no communication); round r > 0 draws other prompts, for
    --dynamic_sampling."""
    args, G = run.args, run.args.num_generations
    rows, prompt_ids, seeds = round_prompts(run, index, r)
    run.engine.wake_up()
    start = time.time()
    if args.max_turns == 1:  # one generate call: every token is the model's
        completion_ids, sampler_logp, action_mask, finish = single_turn(
            run.engine, run.model, run.tokenizer, prompt_ids, seeds,
            max_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
        )
    else:  # tool turns (common/engines/multiturn.py): tool output is context, not actions
        from common.engines.multiturn import sample_completions, tool_metrics

        out = sample_completions(
            run.engine, run.model, run.tokenizer, prompt_ids, seeds,
            max_tokens=args.max_completion_length, temperature=args.temperature,
            top_p=args.top_p, max_turns=args.max_turns, tool=args.tool,
        )
        metrics.update(tool_metrics(out))  # turns, calls, errors, tool time
        completion_ids = out.completion_ids
        sampler_logp = out.sampler_logp
        action_mask = out.action_mask
        finish = out.finish
    # a step may sample several batches (--rollout_lag): their times add up
    metrics["time/rollout"] = metrics.get("time/rollout", 0.0) + time.time() - start
    run.engine.sleep()
    completions = run.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    columns = {c: [v for v in rows[c] for _ in range(G)] for c in run.reward_columns}
    prompts = [p for p in rows["prompt"] for _ in range(G)]
    try:
        # (B,) each function's call at most reward_timeout s; TRL-style functions get the token ids
        # and a trainer_state whose global_step is the steps done before this one
        rewards, per_func = compute_rewards(
            run.reward_funcs, run.reward_weights, prompts, completions, columns,
            args.reward_timeout, completion_ids, step=index,
        )
    # its message names the function and the sample; the step is the loop's to say
    except RewardError as e:
        raise RewardError(f"step {index + 1}: {e}") from e.__cause__
    # DAPO: a reward term, falling to -overlong_penalty at the length limit
    if args.overlong_buffer > 0:
        from common.dapo import overlong_penalty

        lengths = torch.tensor([len(c) for c in completion_ids])  # (B,)
        per_func["overlong"] = overlong_penalty(
            lengths, args.max_completion_length, args.overlong_buffer, args.overlong_penalty,
        )
        rewards = rewards + per_func["overlong"]  # (B,)
    truncated = torch.tensor([f == "length" for f in finish])  # (B,)
    return Rollouts(
        prompt_ids, completion_ids, sampler_logp, rewards, per_func, truncated, action_mask,
    )


def round_prompts(run, index: int, r: int) -> tuple[dict, list[list[int]], list[int]]:
    """This process's prompts of step `index`, round r: their dataset rows, G copies of each one's
    ids, their seeds."""
    args, G, accelerator = run.args, run.args.num_generations, run.accelerator
    positions, indices = step_prompts(
        index, args.batch_size, G, args.mini_batch_size, accelerator.num_processes,
        accelerator.process_index, len(run.train_data), args.seed + 1_000_003 * r,
    )
    seeds = [sample_seed(args.seed, index, position + r * args.batch_size, j)
             for position in positions for j in range(G)]
    rows = run.train_data[indices]  # {column: values}
    return rows, [p for p in rows["prompt_ids"] for _ in range(G)], seeds


def to_tensors(rollouts: Rollouts, removed: torch.Tensor, pad_token_id: int) -> Batch:
    """[left-padded prompt | right-padded completion] and the per-token tensors of the loss."""
    prompts = pad_rows(rollouts.prompt_ids, pad_token_id, left=True)  # (B, P)
    # from the lengths, not `prompts != pad`: a chat template's end-of-turn token is often the pad
    # token too
    prompt_tokens = pad_rows([[1] * len(p) for p in rollouts.prompt_ids], 0, left=True)  # (B, P)
    # (B, T) EOS included
    completion_tokens = pad_rows([[1] * len(c) for c in rollouts.completion_ids], 0)
    return Batch(
        # (B, P+T)
        input_ids=torch.cat([prompts, pad_rows(rollouts.completion_ids, pad_token_id)], dim=1),
        attention_mask=torch.cat([prompt_tokens, completion_tokens], dim=1),  # (B, P+T)
        completion_tokens=completion_tokens,
        mask=completion_tokens * pad_rows(rollouts.action_mask, 0) * ~removed[:, None],  # (B, T)
        sampler_logp=pad_rows(rollouts.sampler_logp, 0.0),  # (B, T)
        rewards=rollouts.rewards, truncated=rollouts.truncated, per_func=rollouts.per_func,  # (B,)
    )


def old_and_reference_logprobs(run, batch: Batch,
                               metrics: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, T) each, taken when the batch is sampled: old_logp, the trainer's log-probs at the
    weights that sampled (--old_logp_source sampler: the sampler's); ref_logp, the reference's, or
    None without a KL term.

    On-policy (`run.on_policy`: one optimizer step per batch, no lag) the weights being trained are
    the ones that sampled, so old_logp is the update's own log-probs, which the loop records as it
    computes them: no extra pass. Until then it is NaN, so that a row the update did not reach
    cannot pass for a log-prob."""
    args = run.args
    start = time.time()
    if run.on_policy:
        # (B, T) the update fills it in
        old_logp = torch.full_like(batch.sampler_logp, float("nan"))
    elif args.old_logp_source == "sampler":
        old_logp = batch.sampler_logp.clone()  # (B, T)
    else:
        old_logp = logprobs_of(run, run.model, batch)  # (B, T)
    ref_logp = None
    if args.beta > 0 and run.ref_model is not None:
        ref_logp = logprobs_of(run, run.ref_model, batch, top_p=1.0)  # (B, T)
    elif args.beta > 0:
        # LoRA: the reference is the base model, the adapter off
        with run.accelerator.unwrap_model(run.model).disable_adapter():
            ref_logp = logprobs_of(run, run.model, batch, top_p=1.0)  # (B, T)
    metrics["time/logprobs"] = metrics.get("time/logprobs", 0.0) + time.time() - start
    return old_logp, ref_logp


def log_ratio_now(run, batch: Batch, rows: slice) -> torch.Tensor:
    """(rows, T) logp - old_logp at the current weights, without gradient, for batch statistics that
    need it (snib.py, p3o.py). On-policy it is 0: the current weights sampled the batch (no pass).
    """
    if run.on_policy:
        return torch.zeros_like(batch.sampler_logp[rows])
    return logprobs_of(run, run.model, batch, rows) - batch.old_logp[rows]


def current_and_old_logprobs(run, batch: Batch, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, T) each, without gradient: the log-probs at the current weights (one pass, on-policy
    too: covpo.py), and the old policy's; on-policy the two are the same, as the current weights
    sampled the batch."""
    logp_now = logprobs_of(run, run.model, batch, rows)  # (rows, T)
    if run.on_policy:
        return logp_now, logp_now
    return logp_now, batch.old_logp[rows]


def logprobs_of(run, net, batch: Batch, rows: slice | None = None,
                top_p: float | None = None) -> torch.Tensor:
    """(rows, T) log-probs of the completions under `net`, without gradient: --logprob_batch_size
    rows per forward, of similar lengths; the rows of a prompt share one forward of it (unless the
    weights are sharded, or --share_prompts false). `top_p` (default --top_p): the policy's
    log-probs are those of the distribution sampled, renormalised over each position's kept set when
    top_p < 1; the reference's are its full softmax's (top_p=1.0: docs/rollouts.md says why)."""
    rows = slice(0, run.local_rows) if rows is None else rows
    top_p = run.args.top_p if top_p is None else top_p
    share = run.share_prompts  # --share_prompts, unless the weights are sharded
    size = run.args.logprob_batch_size or run.args.micro_batch_size
    with torch.no_grad():
        # similar lengths
        buckets = length_buckets(batch.completion_tokens[rows], size, offset=rows.start)
        T, temperature = batch.mask.shape[1], run.args.temperature
        logp = torch.cat([completion_logprobs(net, batch.input_ids[s], batch.attention_mask[s], T,
                                              temperature, share_prompts=share, top_p=top_p,
                                              with_entropy=False)[0]
                          for s in buckets])  # (rows, T) by bucket; the entropy is not read
        return logp[torch.cat(buckets).argsort()]  # (rows, T) in row order


def step_prompts(step: int, batch_size: int, num_generations: int, mini_batch_size: int,
                 num_processes: int, process_index: int, dataset_size: int,
                 seed: int) -> tuple[list[int], list[int]]:
    """This process's prompts at `step`: (their indices within the step's global batch, their
    dataset rows).

    The step's N prompts are consecutive entries of a seeded per-epoch permutation of the dataset.
    Mini-batch k is prompts [k*Nm, (k+1)*Nm) of the step and each process takes a contiguous 1/P of
    every mini-batch, so the global batch, and every optimizer step's share of it, does not depend
    on P."""
    N, Nm = batch_size // num_generations, (mini_batch_size or batch_size) // num_generations
    # (N / P,) this process's share of every mini-batch
    shares = torch.arange(N).view(N // Nm, num_processes, Nm // num_processes)
    positions = shares[:, process_index].flatten()
    stream = step * N + positions  # (n,) positions in the endless stream of prompts
    epochs = stream // dataset_size
    perms = {e: torch.randperm(dataset_size, generator=torch.Generator().manual_seed(seed + e))
             for e in set(epochs.tolist())}
    rows = [int(perms[int(e)][o]) for e, o in zip(epochs, stream % dataset_size)]
    return positions.tolist(), rows


# ---------------------------------------------------------------------------
# The update's batches: mini-batches, micro-batches and the whole batch's statistics
# ---------------------------------------------------------------------------


@dataclass
class BatchStats:
    """What an estimator's compute_loss needs from the whole optimizer batch. A script's
    `Stats(BatchStats)` names its fields: whole-batch totals, and fields declared with
    `BatchStats.per_row()`, which hold one value per row."""

    @staticmethod
    def per_row():
        """A field of a `Stats` dataclass holding (rows,) values of the mini-batch, cut to a
        micro-batch's rows: `log_weight: torch.Tensor = BatchStats.per_row()`."""
        return field(metadata={"per_row": True})

    def for_rows(self, rows: torch.Tensor):
        """The statistics of a micro-batch: the totals as they are, the per-row values of `rows`
        (positions within the mini-batch)."""
        per_row = [f.name for f in fields(self) if f.metadata.get("per_row")]
        return replace(self, **{name: getattr(self, name)[rows] for name in per_row})

    def per_row_values(self) -> dict[str, torch.Tensor]:
        """The per-row fields by name (--dump_stats_steps saves them; e.g. SNIB's log-weights)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("per_row")}


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over the tokens the loss sees."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def minibatches(run) -> list[slice]:
    """This process's rows of each mini-batch (one optimizer step each); the whole batch when there
    is one."""
    starts = range(0, run.local_rows, run.local_mini)
    return [slice(start, start + run.local_mini) for start in starts]


def microbatches(run, batch, mini: slice, whole_groups: bool = False) -> list[torch.Tensor]:
    """The rows of `mini` in groups of --micro_batch_size, of similar completion lengths (less
    padding); `whole_groups`: each micro-batch holds whole groups of G rows, in their order."""
    unit = run.args.num_generations if whole_groups else 1
    size = run.args.micro_batch_size
    return length_buckets(batch.completion_tokens[mini], size, offset=mini.start, unit=unit)


def length_buckets(mask: torch.Tensor, size: int, offset: int = 0,
                   unit: int = 1) -> list[torch.Tensor]:
    """Rows offset + i of `mask` (rows, T) in groups of `size`, longest completions first: each
    group's forward runs on its own longest row's columns (completion_logprobs), so rows of similar
    length together waste little padding. A micro-batch's gradient adds up the same whatever rows it
    holds (the loss normalisers are the optimizer batch's), so only the order of floating-point sums
    changes. `unit` > 1 (`size` a multiple of it) keeps consecutive runs of `unit` rows together and
    in order (a loss that needs whole groups in a micro-batch), sorted by each run's longest row."""
    longest = mask.sum(-1).view(-1, unit).amax(-1)  # (rows / unit,)
    units = torch.argsort(longest, descending=True, stable=True)  # (rows / unit,)
    # (rows,)
    order = (units[:, None] * unit + torch.arange(unit, device=mask.device)).flatten() + offset
    return list(order.split(size))


def gather_rows(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Every process's rows of each (B, T) tensor, in process order: (P B, T') each, T' the longest
    T of any process (the shorter right-padded with 0), all in the first tensor's dtype. For a
    statistic that ranks the tokens of the whole optimizer batch together (covpo.py)."""
    from accelerate.utils import gather, pad_across_processes

    mine = torch.stack([t.to(tensors[0].dtype) for t in tensors], -1)  # (B, T, k)
    return list(gather(pad_across_processes(mine, dim=1)).unbind(-1))  # (P B, T') each


def own_rows(x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """This process's (B, T) rows of a tensor of every process's rows (gather_rows): a contiguous
    share, in process order."""
    from accelerate import PartialState

    B, T = shape
    rank = PartialState().process_index
    return x[rank * B:(rank + 1) * B, :T]


def rows_of(x: torch.Tensor | None, rows) -> torch.Tensor | None:
    """x[rows], or None for an absent tensor (ref_logp without a KL term, tis_weights without
    --tis_cap)."""
    return None if x is None else x[rows]


def save_dumps(run, step: int, dumps: list) -> None:
    """--dump_stats_steps: the per-row statistics of each optimizer step of `step` (e.g. SNIB's
    log-weights), one file per process; estimators without per-row statistics write nothing."""
    per_row = [stats.per_row_values() for stats in dumps]
    if not any(per_row):
        return
    os.makedirs(os.path.join(run.run_dir, "stats"), exist_ok=True)
    name = f"step_{step + 1:06d}.rank{run.accelerator.process_index}.pt"
    cpu = [{k: v.cpu() for k, v in values.items()} for values in per_row]
    torch.save(cpu, os.path.join(run.run_dir, "stats", name))
