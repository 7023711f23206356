"""REINFORCE++ ("REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
Hu et al. 2025, arXiv:2501.03262), as verl's `reinforce_plus_plus` / `reinforce_plus_plus_baseline`
advantage estimators compute it.

    G_it = R_i - beta sum_{k>=t} mask * (sampler_logp_k - ref_logp_k)
           (k1 KL in the reward, gamma 1: returns)
    A_it = (G_it - mu) / sqrt(var + 1e-8),   mu, var (unbiased): over the whole batch's valid tokens
    --baseline: G_it = R'_i - mean_g R',
                R'_i = R_i - beta sum_t mask * (sampler_logp_t - ref_logp_t)
    L    = -(1/n) sum_{i,t} mask * max(min(r_t A_it, clip(r_t, 1-eps, 1+eps_high) A_it),
                                       c A_it if A_it < 0)

Differs from grpo.py (verl's core_algos.py for the advantages and the loss, OpenRLHF's defaults for
the KL):
- no group std: per-token returns of the outcome reward with the KL penalty folded in (OpenRLHF's
  default: KL in the reward, k1, beta 0.01, gamma 1), whitened over the whole batch's valid tokens
  (verl's masked_whiten): main() adds up the sums of A and A^2 over all processes before any
  mini-batch; --baseline subtracts the group mean first.
- the PPO token clip with verl's dual clip (c 3 for A < 0), eps 0.2; a token mean over the optimizer
  batch (verl's loss_agg_mode token-mean); the KL is in the reward, not the loss; TIS / MIS multiply
  each token's term.
- departures: the KL uses the sampler's log-probs (verl: the trainer's old_logp, the same weights);
  no log-ratio clamp at 20. Tool-output tokens (mask 0) are cut out of the returns, as verl's loop
  does since its PR #7300 (2026-08); verl 0.5.0, the tests' peer, restarted the return at them.

One step, in the order main() runs it, and the files it calls into (benchmarks/step_path.py lists
their functions): the rollouts, through the lagged queue (common/sampling.py, with transformers'
sampler of common/engines/rollout.py and the rewards of common/tasks/rewards.py, the toy's among
them); compute_advantages; the mini- and micro-batches (common/sampling.py again), their log-probs
(common/logprobs.py), batch_stats and compute_loss; the backward and the optimizer step, here.

Run:
    python reinforcepp.py --preset toy                           # CPU, minutes
    accelerate launch reinforcepp.py --model Qwen/Qwen3-4B --dataset gsm8k
"""

import os
import time
from dataclasses import dataclass
from functools import partial

import torch

from common.args import TrainArgs, arg
from common.logprobs import completion_logprobs, logprob_metrics
from common.offpolicy import importance_weights
from common.run import end_step, finish, launch, progress_bar, setup
from common.sampling import (
    BatchStats,
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
    beta: float = arg(0.01, "KL coefficient, a k1 penalty in each token's reward "
                            "(OpenRLHF's init_kl_coef)", at_least=0)
    epsilon: float = arg(
        0.2, "lower clip range (verl's clip_ratio, OpenRLHF's eps_clip)", at_least=0,
    )
    epsilon_high: float = arg(0.2, "upper clip range", at_least=0)
    clip_ratio_c: float = arg(3.0, "dual clip: a token with A < 0 loses at most c |A| "
                                   "(verl's clip_ratio_c)", at_least=1)
    baseline: bool = arg(
        False, "REINFORCE++-baseline: subtract the group mean reward before whitening (verl)",
    )


# ALGO LOGIC: advantages and loss
def compute_advantages(rewards: torch.Tensor, args: Args,
                       kl: torch.Tensor | None = None) -> torch.Tensor:
    """The returns before whitening; rows of one prompt are contiguous. `kl` (B, T): mask *
    (sampler_logp - ref_logp), the k1 penalty of each token (None: beta is 0). (B,) without it or
    with --baseline, else (B, T)."""
    if args.baseline:  # REINFORCEPP: verl's reinforce_plus_plus_baseline
        if kl is not None:
            rewards = rewards - args.beta * kl.sum(-1)  # (B,)  R'_i = R_i - beta KL_i
        grouped = rewards.view(-1, args.num_generations)  # (N, G)
        return (grouped - grouped.mean(dim=1, keepdim=True)).flatten()  # (B,)  R'_i - mean_g R'
    if kl is None:
        return rewards.clone()  # (B,)  REINFORCEPP: every token's return is R_i
    # (B, T)  REINFORCEPP: G_it, gamma 1
    return rewards[:, None] - args.beta * kl.flip(-1).cumsum(-1).flip(-1)


def token_kl(batch) -> torch.Tensor | None:
    """(B, T) mask * (sampler_logp - ref_logp), the k1 penalty of each token; None without a KL
    term."""
    if batch.ref_logp is None:
        return None
    return batch.mask * (batch.sampler_logp - batch.ref_logp)  # (B, T)


def whiten(advantages: torch.Tensor, mask: torch.Tensor, total=lambda x: x) -> torch.Tensor:
    """verl's masked_whiten over the whole batch: (A - mu) / sqrt(var + 1e-8), var unbiased; 0 off
    mask. `total` sums a tensor over the processes (main's all-reduce; alone, the identity)."""
    A = (advantages if advantages.dim() == 2 else advantages[:, None]) * mask  # (B, T)
    n = total(mask.sum().to(A.dtype))  # ()  valid tokens of the whole batch
    sum_a = total(A.sum())  # ()
    sum_a2 = total((A * A).sum())  # ()
    A = advantages if advantages.dim() == 2 else advantages[:, None].expand(mask.shape)  # (B, T)
    mean = sum_a / n.clamp(min=1)
    # Bessel's correction
    var = (sum_a2 / n.clamp(min=1) - mean**2).clamp(min=0) * n / (n - 1).clamp(min=1)
    return (A - mean) * torch.rsqrt(var + 1e-8) * mask  # (B, T)


@dataclass
class Stats(BatchStats):
    """The loss's denominators over the whole optimizer batch (every process's rows)."""

    num_tokens: torch.Tensor  # ()  valid tokens  REINFORCEPP: a token mean over the optimizer batch


def batch_stats(advantages, mask, args: Args, total=lambda x: x) -> Stats:
    """What compute_loss needs from the whole optimizer batch when it is called per micro-batch.
    `total` sums a tensor over the processes (the loop's all-reduce; alone, the identity)."""
    return Stats(num_tokens=total(mask.sum().float()))


def compute_loss(logp, old_logp, ref_logp, advantages, mask, args: Args, stats=None,
                 tis_weights=None):
    """PPO loss with verl's dual clip on whitened advantages (B,) or (B, T), full-batch semantics.
    `num_tokens` (default: this batch's valid tokens) is the denominator over the whole optimizer
    batch per micro-batch; `tis_weights` (B, T) multiply each token's term. The KL is in the
    advantages; ref_logp only feeds policy/kl."""
    if stats is None:
        stats = batch_stats(advantages, mask, args)
    mask = mask.float()  # (B, T)
    ratio = torch.exp(logp - old_logp)  # (B, T)  r_t
    A = advantages if advantages.dim() == 2 else advantages[:, None]  # (B, T) or (B, 1)
    clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)  # (B, T)
    surrogate = torch.min(ratio * A, clipped * A)  # (B, T)  s_t
    # (B, T)  REINFORCEPP: verl's dual clip, no gradient
    dual = (A < 0) & (surrogate < args.clip_ratio_c * A)
    surrogate = torch.where(dual, args.clip_ratio_c * A, surrogate)  # (B, T)
    if tis_weights is not None:
        surrogate = surrogate * tis_weights  # (B, T)
    # REINFORCEPP: token mean over the optimizer batch
    loss = -(surrogate * mask).sum() / stats.num_tokens.clamp(min=1)

    with torch.no_grad():
        is_low = (ratio < 1 - args.epsilon) & (A < 0)  # (B, T) clipped from below (gradient zeroed)
        is_high = (ratio > 1 + args.epsilon_high) & (A > 0)  # (B, T)
        metrics = {
            "loss/policy": loss.detach(),
            "policy/ratio_mean": masked_mean(ratio, mask),
            "policy/clip_frac_low": masked_mean(is_low.float(), mask),
            "policy/clip_frac_high": masked_mean(is_high.float(), mask),
            "policy/clip_frac": masked_mean((is_low | is_high).float(), mask),
            "policy/dual_clip_frac": masked_mean(dual.float(), mask),
        }
        if args.beta > 0:
            kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # (B, T)  k3, logged
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
        advantages = compute_advantages(batch.rewards, args, token_kl(batch))  # REINFORCEPP: G_it
        advantages = whiten(advantages, mask, total)  # REINFORCEPP: (B, T), over the whole batch
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
                stats = batch_stats(advantages[mini], mask[mini], args, total)  # whole-batch
                dumps.append(stats)  # --dump_stats_steps (e.g. SNIB's Figure 2)
                for rows in microbatches(run, batch, mini):  # (b,) indices of this process's rows
                    input_ids = batch.input_ids[rows]  # (b, P+T)
                    attention = batch.attention_mask[rows]  # (b, P+T)
                    with accelerator.accumulate(model):
                        logp, entropy = completion_logprobs(
                            model, input_ids, attention, T, args.temperature,
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
