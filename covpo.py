"""Clip-Cov / KL-Cov ("The Entropy Mechanism of Reinforcement Learning for Reasoning Language
Models", Cui et al. 2025, arXiv:2505.22617): keep the policy's entropy from collapsing by
restraining the few tokens whose log-prob and advantage co-vary most, the tokens that drive the
entropy down.

    A_i = (R_i - mean_g R) / (std_g R + 1e-6),   r_t = exp(logp_t - old_logp_t)
    C_t = (A_i - mean A) (logp_t - mean logp),   logp at the current weights, means over the
          batch's n valid tokens
    Clip-Cov: L = -(1/n) sum_{i,t} mask (1 - S_t) min(r_t A_i, clip(r_t, 1-eps, 1+eps_high) A_i),
              S_t = 1 on max(int(r n), 1) tokens drawn at random among those with lb < C_t < ub
              that the clip leaves alone
    KL-Cov:   L = -(1/n) sum_{i,t} mask [r_t A_i - kappa S_t |logp_t - old_logp_t|],
              S_t = 1 on the top max(int(k n), 1) tokens by C_t

Differs from grpo.py (verl 0.5.0's compute_policy_loss_clip_cov / _kl_cov, from the authors' code):
- a token mean over the optimizer batch (verl's token-mean); beta 0; KL-Cov has no ratio clip.
- the selection is the optimizer batch's: batch_stats gathers every process's rows (logp at the
  current weights, one no-grad pass per optimizer step) and ranks them together; verl ranks each
  micro-batch of each process alone.
- Clip-Cov draws with torch.randperm on the global RNG, as verl does: the same draw on every process
  (one seed).
- TIS / MIS multiply each token's whole term, KL-Cov's penalty included.

One step, in the order main() runs it, and the files it calls into (benchmarks/step_path.py lists
their functions): the rollouts, through the lagged queue (common/sampling.py, with transformers'
sampler of common/engines/rollout.py and the rewards of common/tasks/rewards.py, the toy's among
them); compute_advantages; the mini- and micro-batches (common/sampling.py again), their log-probs
(common/logprobs.py), batch_stats and compute_loss; the backward and the optimizer step, here.

Run:
    python covpo.py --preset toy                                 # CPU, minutes
    accelerate launch covpo.py --model Qwen/Qwen3-4B --dataset gsm8k
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
    current_and_old_logprobs,  # COVPO:
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
        0.0, "KL coefficient to the reference policy (k3; the authors' use_kl_loss off)",
        at_least=0,
    )
    epsilon: float = arg(
        0.2, "lower clip range, Clip-Cov (verl's clip_ratio_low; the authors' Clip-Cov 1)",
        at_least=0,
    )
    epsilon_high: float = arg(
        0.2, "upper clip range, Clip-Cov only (verl's clip_ratio_high)", at_least=0,
    )
    cov_method: Literal["clip", "kl"] = arg("clip", "clip: Clip-Cov drops a few high-covariance "
                                                    "tokens from the loss; kl: KL-Cov puts a "
                                                    "|log-ratio| penalty on the top ones")
    clip_cov_ratio: float = arg(2e-4, "Clip-Cov: share of the batch's tokens dropped, r (verl's "
                                      "and the authors')", at_least=0)
    clip_cov_lb: float = arg(
        1.0, "Clip-Cov: lowest covariance a dropped token may have (verl's clip_cov_lb)",
    )
    clip_cov_ub: float = arg(
        5.0, "Clip-Cov: highest covariance a dropped token may have (verl's clip_cov_ub)",
    )
    kl_cov_ratio: float = arg(2e-4, "KL-Cov: share of the batch's tokens penalised, k (verl's; the "
                                    "authors': 2e-3 for Qwen2.5-7B, 2e-4 for 32B)", at_least=0)
    ppo_kl_coef: float = arg(1.0, "KL-Cov: coefficient kappa of the |log-ratio| penalty (the "
                                  "authors' scripts and verl's function: 1; verl's actor.yaml 0.1)",
                             at_least=0)


# ALGO LOGIC: advantages and loss
def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """Group-normalised advantages; rows of one prompt are contiguous."""
    grouped = rewards.view(-1, args.num_generations)  # (N, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (N, G)
    return (centered / (grouped.std(dim=1, keepdim=True) + 1e-6)).flatten()  # (B,)


@dataclass
class Stats(BatchStats):
    """What Clip-Cov and KL-Cov need from the whole optimizer batch: its valid tokens, and the
    tokens the covariance picked, ranked over every process's rows."""

    num_tokens: torch.Tensor  # ()  the token mean's denominator, over every process
    selected: torch.Tensor = BatchStats.per_row()  # (B, T)  COVPO: the tokens the covariance picked


def batch_stats(logp_now, old_logp, advantages, mask, args: Args, total=lambda x: x) -> Stats:
    """What compute_loss needs from the whole optimizer batch when it is called per micro-batch.
    `logp_now` (B, T): log-probs at the current weights, without gradient; `total` sums a tensor
    over the processes."""
    from common.sampling import gather_rows, own_rows  # COVPO: the tokens of every process

    # (B, T) each  COVPO: at the current weights
    logp, A = logp_now, advantages[:, None].expand(mask.shape)
    ratio = torch.exp(logp - old_logp)  # (B, T)
    # (B, T) verl's
    clipped = -A * torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high) > -A * ratio
    # (P B, T') each  COVPO: the selection ranks them together
    logp_all, A_all, valid, clipped = gather_rows(logp, A, mask, clipped)
    valid, n = valid > 0, int(valid.sum())  # (P B, T')  COVPO: the optimizer batch's valid tokens
    mean_A = torch.where(valid, A_all, 0).sum() / max(n, 1)  # ()
    mean_logp = torch.where(valid, logp_all, 0).sum() / max(n, 1)  # ()
    cov = (A_all - mean_A) * (logp_all - mean_logp)  # (P B, T')  COVPO: C_t, centred cross-product
    if args.cov_method == "clip":  # COVPO: Clip-Cov: a random draw among lb < C_t < ub, unclipped
        eligible = torch.nonzero(valid & (clipped == 0) & (cov > args.clip_cov_lb)
                                 & (cov < args.clip_cov_ub))
        # (m, 2)  verl's
        chosen = eligible[torch.randperm(len(eligible))[: max(int(args.clip_cov_ratio * n), 1)]]
    else:  # COVPO: KL-Cov: the top k by C_t
        k = min(max(int(args.kl_cov_ratio * n), 1), n)
        chosen = torch.nonzero(valid)[torch.topk(cov[valid], k).indices]  # (k, 2)
    selected = torch.zeros_like(valid)  # (P B, T')
    selected[chosen[:, 0], chosen[:, 1]] = True
    return Stats(total(mask.sum().float()), selected=own_rows(selected, mask.shape))


def compute_loss(logp, old_logp, ref_logp, advantages, mask, args: Args, stats=None,
                 tis_weights=None):
    """Clip-Cov / KL-Cov loss with full-batch semantics. `stats` hold the optimizer batch's valid
    tokens and the tokens the covariance picked (None: these rows are the whole batch);
    `tis_weights` (B, T) multiply the policy term per token (TIS or masked IS, per token or per
    sequence: common/offpolicy.py)."""
    if stats is None:
        stats = batch_stats(logp.detach(), old_logp, advantages, mask, args)
    selected = stats.selected  # (B, T)
    mask = mask.float()  # (B, T)
    ratio = torch.exp(logp - old_logp)  # (B, T)  r_t
    A = advantages[:, None]  # (B, 1)
    clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)  # (B, T)
    if args.cov_method == "clip":  # COVPO: Clip-Cov: the selected tokens leave the loss
        surrogate = torch.min(ratio * A, clipped * A) * ~selected  # (B, T)  s_t  (verl: corr = 0)
    else:  # COVPO: KL-Cov: no clip; kappa |logp - old_logp| on the selected tokens
        surrogate = ratio * A - (logp - old_logp).abs() * selected * args.ppo_kl_coef  # (B, T)  s_t
    if tis_weights is not None:
        surrogate = surrogate * tis_weights  # (B, T)
    per_token = surrogate  # (B, T)
    if args.beta > 0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # (B, T)  k3
        per_token = per_token - args.beta * kl  # (B, T)
    # COVPO: a token mean over the optimizer batch (verl's)
    loss = -(per_token * mask).sum() / stats.num_tokens.clamp(min=1)

    with torch.no_grad():
        ppo = args.cov_method == "clip"  # KL-Cov has no clip
        # (B, T) clipped from below (gradient zeroed)
        is_low = (ratio < 1 - args.epsilon) & (A < 0) & ppo
        is_high = (ratio > 1 + args.epsilon_high) & (A > 0) & ppo  # (B, T)
        metrics = {
            "loss/policy": loss.detach(),
            "policy/ratio_mean": masked_mean(ratio, mask),
            "policy/clip_frac_low": masked_mean(is_low.float(), mask),
            "policy/clip_frac_high": masked_mean(is_high.float(), mask),
            "policy/clip_frac": masked_mean((is_low | is_high).float(), mask),
            # Clip-Cov: dropped; KL-Cov: penalised
            "covpo/selected_frac": masked_mean(selected.float(), mask),
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
                # COVPO: a pass, on-policy too
                logp_now, old_logp = current_and_old_logprobs(run, batch, mini)  # COVPO:
                stats = batch_stats(logp_now, old_logp,  # COVPO:
                                    advantages[mini], mask[mini], args, total)  # COVPO:
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
