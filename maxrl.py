"""MaxRL: Maximum Likelihood Reinforcement Learning ("Maximum Likelihood Reinforcement Learning",
Tajwar et al. 2026, arXiv:2602.02710): the group's mean reward (its success rate) normalises the
advantage in place of its std.

    A_i = (R_i - mean_g R) / (mean_g R + 1e-6)  (0 where mean_g R <= 0)
    r_t = exp(logp_t - old_logp_t)
    L   = -(1/n) sum_{i,t} mask * [max(min(r_t A_i, clip(r_t, 1-eps, 1+eps_high) A_i),
                                       c A_i if A_i < 0) - beta kl_t]

With binary rewards and K successes of G: A = (G - K) / K on a success, -1 on a failure, so the
gradient is (1/K) sum_{successes} grad log pi: the maximum-likelihood gradient of the successes'
share, an unbiased estimate of the order-G truncation of the log pass rate's gradient (the paper; G
= 1 is REINFORCE, G -> infinity maximum likelihood).

Differs from grpo.py (the authors' verl fork, `compute_maxrl_outcome_advantage`; prime-rl's
`max_rl`):
- the group mean replaces the std: (R - mean) / (mean + 1e-6) as the authors' verl fork; 0 where
  mean <= 0, as prime-rl (for rewards >= 0 the two agree: such a group's rewards are all 0). Meant
  for rewards >= 0 (a pass rate).
- the rest is verl's defaults, which that fork keeps: the PPO token clip (eps 0.2) with verl's dual
  clip (c 3 for A < 0), a token mean over the optimizer batch (loss_agg_mode token-mean), no KL
  (beta 0; k3 in the loss if set).
- TIS / MIS multiply each token's policy term; no ablation switches.

One step, in the order main() runs it, and the files it calls into (benchmarks/step_path.py lists
their functions): the rollouts, through the lagged queue (common/sampling.py, with transformers'
sampler of common/engines/rollout.py and the rewards of common/tasks/rewards.py, the toy's among
them); compute_advantages; the mini- and micro-batches (common/sampling.py again), their log-probs
(common/logprobs.py), batch_stats and compute_loss; the backward and the optimizer step, here.

Run:
    python maxrl.py --preset toy                                 # CPU, minutes
    accelerate launch maxrl.py --model Qwen/Qwen3-4B --dataset gsm8k
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
    beta: float = arg(
        0.0, "KL coefficient to the reference policy (k3 estimator; verl's use_kl_loss off)",
        at_least=0,
    )
    epsilon: float = arg(0.2, "lower clip range (verl's clip_ratio)", at_least=0)
    epsilon_high: float = arg(0.2, "upper clip range", at_least=0)
    clip_ratio_c: float = arg(3.0, "dual clip: a token with A < 0 loses at most c |A| "
                                   "(verl's clip_ratio_c)", at_least=1)


# ALGO LOGIC: advantages and loss
def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """Mean-normalised advantages (the group's success rate in place of its std); rows of one prompt
    are contiguous."""
    grouped = rewards.view(-1, args.num_generations)  # (N, G)
    mean = grouped.mean(dim=1, keepdim=True)  # (N, 1)  MAXRL: p_hat, the group's pass rate
    A = (grouped - mean) / (mean + 1e-6)  # (N, G)  MAXRL: (R_i - p_hat) / p_hat
    # (B,)  MAXRL: no success, no signal
    return torch.where(mean > 0, A, torch.zeros_like(A)).flatten()


@dataclass
class Stats(BatchStats):
    """The loss's denominators over the whole optimizer batch (every process's rows)."""

    num_tokens: torch.Tensor  # ()  valid tokens  MAXRL: a token mean over the optimizer batch


def batch_stats(advantages, mask, args: Args, total=lambda x: x) -> Stats:
    """What compute_loss needs from the whole optimizer batch when it is called per micro-batch.
    `total` sums a tensor over the processes (the loop's all-reduce; alone, the identity)."""
    return Stats(num_tokens=total(mask.sum().float()))


def compute_loss(logp, old_logp, ref_logp, advantages, mask, args: Args, stats=None,
                 tis_weights=None):
    """MaxRL loss (verl's PPO loss with its dual clip) with full-batch semantics. `num_tokens`
    (default: this batch's valid tokens) is the denominator over the whole optimizer batch per
    micro-batch; `tis_weights` (B, T) multiply the policy term per token."""
    if stats is None:
        stats = batch_stats(advantages, mask, args)
    mask = mask.float()  # (B, T)
    ratio = torch.exp(logp - old_logp)  # (B, T)  r_t
    A = advantages[:, None]  # (B, 1)
    clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)  # (B, T)
    surrogate = torch.min(ratio * A, clipped * A)  # (B, T)  s_t
    # (B, T)  MAXRL: verl's dual clip, no gradient
    dual = (A < 0) & (surrogate < args.clip_ratio_c * A)
    surrogate = torch.where(dual, args.clip_ratio_c * A, surrogate)  # (B, T)
    if tis_weights is not None:
        surrogate = surrogate * tis_weights  # (B, T)
    per_token = surrogate  # (B, T)
    if args.beta > 0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # (B, T)  k3
        per_token = per_token - args.beta * kl  # (B, T)
    # MAXRL: token mean over the optimizer batch
    loss = -(per_token * mask).sum() / stats.num_tokens.clamp(min=1)

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
