"""P3O: Policy-on Policy-off Policy Optimization (Fakoor et al. 2019, arXiv:1905.01756) with the
batch ESS of "Trust the Batch, On- or Off-Policy: Adaptive Policy Optimization for RL Post-Training"
(code: FeynRL's algs/P3O/p3o.py, github.com/FeynRL-project/FeynRL).

    A_i = z-score,   r_t = exp(logp_t - old_logp_t)
    ESS = (sum r)^2 / (n sum r^2) over the batch's n valid tokens
    L   = (1/n) sum_{i,t} mask [-sg(min(r_t, ESS)) A_i logp_t + (1-ESS) kl_old_t + beta kl_ref_t
                                - entropy_coeff H_t]

Differs from grpo.py:
- no clip: the batch ESS caps a detached score-function weight and weighs a KL to the behaviour
  policy, kl_old_t = (logp - old_logp) + exp(clamp(old_logp - logp, -10, 10)) - 1; a token mean over
  the batch.
- ESS over every valid token of the optimizer batch, all processes; --ess_scope micro_batch: each
  micro-batch's own (FeynRL's choice, a departure from full-batch semantics:
  docs/estimators/conventions.md).

One step, in the order main() runs it, and the files it calls into (benchmarks/step_path.py lists
their functions): the rollouts, through the lagged queue (common/sampling.py, with transformers'
sampler of common/engines/rollout.py and the rewards of common/tasks/rewards.py, the toy's among
them); compute_advantages; the mini- and micro-batches (common/sampling.py again), their log-probs
(common/logprobs.py), batch_stats and compute_loss; the backward and the optimizer step, here.

Run:
    python p3o.py --preset toy                                   # CPU, minutes
    accelerate launch p3o.py --model Qwen/Qwen3-4B --dataset gsm8k
"""

import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from common.args import TrainArgs, arg
from common.logprobs import completion_logprobs, logprob_metrics
from common.offpolicy import importance_weights
from common.run import end_step, finish, launch, progress_bar, setup
from common.sampling import (
    BatchStats,
    log_ratio_now,  # P3O:
    masked_mean,
    microbatches,
    minibatches,
    old_and_reference_logprobs,
    rows_of,
    sample_batch,
    save_dumps,
)


@dataclass
class Args(TrainArgs):
    """The estimator's flags. The run's, the model's, the data's, the rollouts' and the
    optimisation's are TrainArgs' (common/args.py); --help lists them all."""

    exp_name: str = arg(os.path.basename(__file__)[: -len(".py")], "name of this experiment")
    # Algorithm-specific
    beta: float = arg(
        0.0, "KL coefficient to the reference policy (kl_old's estimator)", at_least=0,
    )
    entropy_coeff: float = arg(
        0.0, "entropy bonus; > 0 needs the entropy with gradient", at_least=0,
    )
    ess_scope: Literal["batch", "micro_batch"] = arg(
        "batch", "ESS over the batch, or each micro-batch (FeynRL)",
    )


# ALGO LOGIC: advantages and loss
def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """Group-normalised advantages; rows of one prompt are contiguous."""
    grouped = rewards.view(-1, args.num_generations)  # (N, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (N, G)
    return (centered / (grouped.std(dim=1, keepdim=True) + 1e-6)).flatten()  # (B,)


@dataclass
class Stats(BatchStats):
    """What P3O's loss needs from the whole optimizer batch: sums over its valid tokens at the
    current weights, ESS = (sum r)^2 / (n sum r^2). float64: r^2 overflows float32."""

    num_tokens: torch.Tensor  # ()  n, the valid tokens: the token mean's denominator
    sum_r: torch.Tensor | None = None  # ()  sum r_t (None: --ess_scope micro_batch)
    sum_r2: torch.Tensor | None = None  # ()  sum r_t^2


def batch_stats(log_ratio, advantages, mask, args: Args, total=lambda x: x) -> Stats:
    """What compute_loss needs from the whole optimizer batch when it is called per micro-batch.
    `log_ratio` (B, T): logp - old_logp at the current weights; `total` sums a tensor over the
    processes."""
    # P3O: ESS needs sum r, sum r^2 and n over every valid token of the optimizer batch, at the
    # current weights; --ess_scope micro_batch leaves them to each micro-batch's own forward and
    # keeps the batch's token count.
    if args.ess_scope == "micro_batch":
        return Stats(num_tokens=total(mask.double().sum()))
    return ess_sums(log_ratio, mask, total)


def ess_sums(log_ratio, mask, total=lambda x: x) -> Stats:
    """sum r, sum r^2 and n over the valid tokens of these rows: ESS = (sum r)^2 / (n sum r^2)."""
    delta = log_ratio.double().masked_fill(mask == 0, 0)  # (B, T)  float64: r^2 overflows fp32
    ratio = torch.exp(delta) * mask  # (B, T)  r_t on valid tokens, 0 on padding
    num_tokens = total(mask.double().sum())  # ()
    return Stats(num_tokens, sum_r=total(ratio.sum()), sum_r2=total((ratio**2).sum()))


def compute_loss(logp, old_logp, ref_logp, advantages, mask, args: Args, stats=None,
                 tis_weights=None, entropy=None):
    """P3O loss with full-batch semantics: `stats` are the optimizer batch's sums over valid tokens
    at the current weights (None: these rows are the whole batch); `tis_weights` (B, T) scale the
    policy term, not the trust region; `entropy` (B, T) carries its gradient when entropy_coeff > 0.
    """
    if args.entropy_coeff > 0 and (entropy is None
                                   or (logp.requires_grad and not entropy.requires_grad)):
        raise ValueError("--entropy_coeff > 0 needs the entropy's gradient: "
                         "completion_logprobs(entropy_grad=True)")
    if stats is None:
        stats = batch_stats(logp.detach() - old_logp, advantages, mask, args)
    own = stats  # the optimizer batch's sums
    if stats.sum_r is None:  # --ess_scope micro_batch: these rows' own
        own = ess_sums(logp.detach() - old_logp, mask)
    mask = mask.float()  # (B, T)
    # ()  P3O: 0 if no token
    ess = (own.sum_r**2 / (own.num_tokens * own.sum_r2).clamp(1e-300)).to(logp.dtype)
    delta = logp - old_logp  # (B, T)
    ratio = torch.exp(delta.detach().masked_fill(mask == 0, 0))  # (B, T)  r_t
    A = advantages[:, None]  # (B, 1)
    # (B, T)  P3O: -sg(clamp(r_t, 0, ESS)) logp_t A_i
    per_token = -torch.clamp(ratio, max=ess) * logp * A
    if tis_weights is not None:
        per_token = per_token * tis_weights  # (B, T)
    # (B, T)  P3O: KL to the behaviour policy
    kl_old = delta + torch.exp(torch.clamp(-delta, -10, 10)) - 1
    per_token = per_token + (1 - ess) * kl_old  # (B, T)  P3O: adaptive trust region
    if args.beta > 0:
        # (B, T)  P3O: kl_old's form
        kl = (logp - ref_logp) + torch.exp(torch.clamp(ref_logp - logp, -10, 10)) - 1
        per_token = per_token + args.beta * kl  # (B, T)
    if args.entropy_coeff > 0:
        per_token = per_token - args.entropy_coeff * entropy  # (B, T)  P3O: entropy bonus
    # P3O: token mean over the optimizer batch
    loss = (per_token * mask).sum() / stats.num_tokens.to(logp.dtype)

    with torch.no_grad():
        metrics = {
            "loss/policy": loss.detach(),
            "policy/ratio_mean": masked_mean(ratio, mask),
            "p3o/ess": ess,
            "p3o/behaviour_kl": masked_mean(kl_old, mask),
            "p3o/capped_frac": masked_mean((ratio > ess).float(), mask),
        }
        if args.beta > 0:
            metrics["policy/kl"] = masked_mean(kl, mask)
    return loss, metrics


def main(args: Args):
    # The processes, the run folder, the policy (+ LoRA), the reference, the data, the optimizer
    # and the rollout engine (common/run.py).
    run = setup(args)
    model = run.model
    optimizer = run.optimizer
    scheduler = run.scheduler
    accelerator = run.accelerator
    total = partial(accelerator.reduce, reduction="sum")  # a tensor's sum over the processes
    # compute_loss returns a micro-batch's share of the whole batch's loss (its denominators are the
    # batch's). accelerate divides each loss by the accumulation steps and DDP averages gradients
    # over the processes, so each share is scaled back by both: the gradients then add up to the
    # batch loss's, whatever the micro-batch size and the number of processes.
    loss_scale = accelerator.gradient_accumulation_steps * accelerator.num_processes
    progress = progress_bar(run)
    for step in progress:
        step_start = time.time()
        metrics = {}

        # 1. Rollouts and rewards, with the log-probs of the weights that sampled them (the
        # behaviour policy's, old) and the reference's. --rollout_lag K: the batch of step + K
        # is sampled now, this step's K steps ago.
        for index in run.queue.steps_to_sample(step, args.total_steps):  # [step] at lag 0
            batch = sample_batch(run, index, metrics)  # this process's rows of step `index`
            batch.old_logp, batch.ref_logp = old_and_reference_logprobs(run, batch, metrics)
            run.queue.put(batch, sampled_at=step)
        batch = run.queue.take(step)
        mask = batch.mask  # (B, T)
        T = mask.shape[1]

        # 2. Advantages, and for a sampler/trainer mismatch, truncated or masked importance weights
        advantages = compute_advantages(batch.rewards, args)  # (B,)
        tis_weights = None
        if args.tis_cap > 0:
            tis_weights, metrics["rollout/is_masked_frac"] = importance_weights(
                batch.old_logp, batch.sampler_logp, mask, args.tis_cap, args.tis_mode, args.mis,
                args.tis_floor,
            )  # (B, T)

        # 3. Policy updates: num_iterations passes over the batch, one optimizer step per mini-batch
        model.train()
        update_start = time.time()
        update_metrics, grad_norms, dumps = [], [], []
        for _ in range(args.num_iterations):
            for mini in minibatches(run):  # a slice of this process's rows
                log_ratio = (log_ratio_now(run, batch, mini)  # P3O:
                             if args.ess_scope == "batch" else None)  # P3O:
                stats = batch_stats(log_ratio, advantages[mini], mask[mini], args, total)  # P3O:
                dumps.append(stats)  # --dump_stats_steps (e.g. SNIB's Figure 2)
                for rows in microbatches(run, batch, mini):  # (b,) indices of this process's rows
                    input_ids = batch.input_ids[rows]  # (b, P+T)
                    attention = batch.attention_mask[rows]  # (b, P+T)
                    with accelerator.accumulate(model):
                        logp, entropy = completion_logprobs(
                            model, input_ids, attention, T, args.temperature,
                            args.entropy_coeff > 0,  # P3O: the bonus needs the entropy's gradient
                            top_p=args.top_p,
                        )
                        if run.on_policy:  # these weights sampled the batch: old is current
                            batch.old_logp[rows] = logp.detach()
                        old_logp = batch.old_logp[rows]  # (b, T)
                        ref_logp = rows_of(batch.ref_logp, rows)  # (b, T), or None: no KL term
                        loss, loss_metrics = compute_loss(
                            logp, old_logp, ref_logp, advantages[rows], mask[rows], args,
                            stats=stats.for_rows(rows - mini.start),
                            tis_weights=rows_of(tis_weights, rows),
                            entropy=entropy,  # P3O:
                        )
                        share = loss * loss_scale  # this micro-batch's share, scaled as said above
                        accelerator.backward(share)
                        loss_metrics["loss/policy"] = share.detach()
                        if accelerator.sync_gradients:  # the mini-batch's last: an optimizer step
                            parameters = model.parameters()
                            grad_norm = accelerator.clip_grad_norm_(parameters, args.max_grad_norm)
                            grad_norms.append(grad_norm)
                            optimizer.step()
                            optimizer.zero_grad()
                    loss_metrics.update(logprob_metrics(entropy, logp, old_logp, mask[rows]))
                    update_metrics.append(loss_metrics)
                scheduler.step()
        metrics["time/update"] = time.time() - update_start
        if args.dump_stats_steps > 0 and (step + 1) % args.dump_stats_steps == 0:
            save_dumps(run, step, dumps)

        # 4. Push the new weights to the sampler; log, evaluate and save
        end_step(run, step, step_start, batch, metrics, update_metrics, grad_norms, progress)
    return finish(run)


if __name__ == "__main__":
    launch(main, Args)  # parse the arguments, train; Ctrl-C says where to resume
