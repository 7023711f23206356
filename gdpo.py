"""GDPO: "GDPO: Group reward-Decoupled Normalization Policy Optimization for Multi-reward RL
Optimization" (Liu et al. 2026, NVIDIA, arXiv:2601.05242).

    A_i^k = (R_i^k - mean_g R^k) / (std_g R^k + 1e-6)       for each reward function k = 1..K
    S_i   = sum_k w_k A_i^k,    A_i = (S_i - mean S) / sqrt(var S + 1e-8)  (K > 1; K = 1: GRPO's)
    L     = -(1/n) sum_{i,t} mask * [min(r_t A_i, clip(r_t, 1-eps, 1+eps_high) A_i) - beta * kl_t]

Differs from grpo.py (the authors' verl-GDPO and TRL-0.18 GDPO code, NVlabs/GDPO; verl 0.9.1's
compute_gdpo_outcome_advantage):
- the advantage: each reward function's own reward (batch.per_func) is z-scored in its group before
  the weighted sum (--reward_weights; DAPO's overlong penalty, when on, is one more reward of
  weight 1), then the sum is whitened over the whole batch (mean and unbiased variance over every
  process's valid tokens: verl's masked_whiten), so its scale does not grow with K. One reward
  function: GRPO's advantage, as the authors' TRL code (verl 0.9.1 whitens it too).
- a token mean over the batch (the authors' TRL recipe: TRL 0.18's bnpo); beta 0.04 and eps 0.2 /
  0.2 (its defaults); no ablation switches.
- from verl: the batch statistics leave out removed rows and tool tokens (mask 0); the authors' TRL
  normalises over rows with std + 1e-4 (TRL 1.16's normalize_then_sum too, for every K).

One step, in the order main() runs it, and the files it calls into (benchmarks/step_path.py lists
their functions): the rollouts, through the lagged queue (common/sampling.py, with transformers'
sampler of common/engines/rollout.py and the rewards of common/tasks/rewards.py, the toy's among
them); compute_advantages; the mini- and micro-batches (common/sampling.py again), their log-probs
(common/logprobs.py), batch_stats and compute_loss; the backward and the optimizer step, here.

Run:
    python gdpo.py --preset toy                                  # CPU, minutes
    accelerate launch gdpo.py --model Qwen/Qwen3-4B --dataset gsm8k
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
    beta: float = arg(0.04, "KL coefficient to the reference policy (k3 estimator)", at_least=0)
    epsilon: float = arg(0.2, "lower clip range", at_least=0)
    epsilon_high: float = arg(0.2, "upper clip range", at_least=0)


# ALGO LOGIC: advantages and loss
def reward_matrix(per_func: dict, device=None) -> torch.Tensor:
    """(B, K) each reward function's reward, in --reward_funcs order (then DAPO's overlong
    penalty, when on), from the batch's per-function rewards (their "name/key" metrics left out)."""
    return torch.stack([r for name, r in per_func.items() if "/" not in name], -1).to(device)


def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """(B,) sum_k w_k z_k: each reward (B, K) (a (B,) tensor: K = 1) z-scored in its group, then
    weighted by --reward_weights (1 for a reward past them); rows of one prompt are contiguous."""
    rewards = rewards if rewards.dim() == 2 else rewards[:, None]  # (B, K)
    K = rewards.shape[1]
    weights = [1.0] * K
    if args.reward_weights:
        given = [float(w) for w in args.reward_weights.split(",")][:K]
        weights[: len(given)] = given
    weights = rewards.new_tensor(weights)  # (K,)
    if K == 1:  # GDPO: one reward is GRPO's advantage of the weighted reward (the authors' TRL)
        rewards = rewards * weights  # (B, 1)
        weights = torch.ones_like(weights)  # (1,)
    grouped = rewards.view(-1, args.num_generations, K)  # (N, G, K)
    # a reward that does not apply to a sample (None, TRL): out of its z-score and sum
    if grouped.isnan().any():
        centered = grouped - grouped.nanmean(dim=1, keepdim=True)  # (N, G, K)
        # (N, 1, K)  the samples each reward applies to
        count = (~grouped.isnan()).sum(dim=1, keepdim=True)
        std = (centered.square().nansum(dim=1, keepdim=True)
               / (count - 1).clamp(min=1)).sqrt()  # (N, 1, K)
        normalised = (centered / (std + 1e-6)).nan_to_num(0.0)  # (N, G, K)
        return (normalised * weights).sum(-1).flatten()  # (B,)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (N, G, K)
    normalised = centered / (grouped.std(dim=1, keepdim=True) + 1e-6)  # (N, G, K)  GDPO: per reward
    return (normalised * weights).sum(-1).flatten()  # (B,)


def batch_normalise(advantages, mask, num_rewards: int, total=lambda x: x) -> torch.Tensor:
    """(B,) verl's masked_whiten of the summed advantages over the whole batch's valid tokens:
    (A - mu) / sqrt(var + 1e-8), var unbiased; one reward (K = 1) is left as it is. `total` sums a
    tensor over the processes (main's all-reduce; alone, the identity)."""
    if num_rewards == 1:
        return advantages
    lengths = mask.float().sum(-1)  # (B,)  each row's valid tokens
    n = total(lengths.sum())  # ()
    mean = total((lengths * advantages).sum()) / (n + 1e-8)  # ()
    var = total((lengths * (advantages - mean) ** 2).sum()) / (n + 1e-8) * n / (n - 1)  # ()
    return (advantages - mean) * torch.rsqrt(var + 1e-8)  # (B,)


@dataclass
class Stats(BatchStats):
    """The loss's denominators over the whole optimizer batch (every process's rows)."""

    num_tokens: torch.Tensor  # ()  valid tokens  GDPO: a token mean over the optimizer batch


def batch_stats(advantages, mask, args: Args, total=lambda x: x) -> Stats:
    """What compute_loss needs from the whole optimizer batch when it is called per micro-batch.
    `total` sums a tensor over the processes (the loop's all-reduce; alone, the identity)."""
    return Stats(num_tokens=total(mask.sum().float()))


def compute_loss(logp, old_logp, ref_logp, advantages, mask, args: Args, stats=None,
                 tis_weights=None):
    """GRPO's PPO-clip loss on GDPO's advantages, a token mean with full-batch semantics:
    `stats.num_tokens` (default: these rows' valid tokens) is the whole optimizer batch's when the
    loss is called per micro-batch. `tis_weights` (B, T) multiply the policy term per token."""
    if stats is None:
        stats = batch_stats(advantages, mask, args)
    mask = mask.float()  # (B, T)
    ratio = torch.exp(logp - old_logp)  # (B, T)  r_t
    A = advantages[:, None]  # (B, 1)
    clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)  # (B, T)
    surrogate = torch.min(ratio * A, clipped * A)  # (B, T)  s_t
    if tis_weights is not None:
        surrogate = surrogate * tis_weights  # (B, T)
    per_token = surrogate  # (B, T)
    if args.beta > 0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # (B, T)  k3
        per_token = per_token - args.beta * kl  # (B, T)
    loss = -(per_token * mask).sum() / stats.num_tokens.clamp(min=1)  # GDPO: token mean

    with torch.no_grad():
        is_low = (ratio < 1 - args.epsilon) & (A < 0)  # (B, T) clipped from below (gradient zeroed)
        is_high = (ratio > 1 + args.epsilon_high) & (A > 0)  # (B, T)
        metrics = {
            "loss/policy": loss.detach(),
            "policy/ratio_mean": masked_mean(ratio, mask),
            "policy/clip_frac_low": masked_mean(is_low.float(), mask),
            "policy/clip_frac_high": masked_mean(is_high.float(), mask),
            "policy/clip_frac": masked_mean((is_low | is_high).float(), mask),
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
        rewards = reward_matrix(batch.per_func, mask.device)  # GDPO: (B, K) each reward function's
        advantages = compute_advantages(rewards, args)  # GDPO: (B,) sum_k w_k z_k
        advantages = batch_normalise(advantages, mask, rewards.shape[1], total)  # GDPO: whitened
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
