"""REINFORCE++ ("REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models", Hu et al. 2025,
arXiv:2501.03262), as verl's `reinforce_plus_plus` / `reinforce_plus_plus_baseline` advantage estimators compute it.

    G_it = R_i - beta sum_{k>=t} mask * (sampler_logp_k - ref_logp_k)       (k1 KL in the reward, gamma 1: returns)
    A_it = (G_it - mu) / sqrt(var + 1e-8),   mu, var (unbiased): over every valid token of the whole batch
    --baseline: G_it = R'_i - mean_g R',  R'_i = R_i - beta sum_t mask * (sampler_logp_t - ref_logp_t)
    L    = -(1/n) sum_{i,t} mask * max(min(r_t A_it, clip(r_t, 1-eps, 1+eps_high) A_it), c A_it if A_it < 0)

Differs from grpo.py (verl's core_algos.py for the advantages and the loss, OpenRLHF's defaults for the KL):
- no group std: per-token returns of the outcome reward with the KL penalty folded in (OpenRLHF's default: KL in the
  reward, k1, beta 0.01, gamma 1), whitened over the whole batch's valid tokens (verl's masked_whiten): main() adds
  up the sums of A and A^2 over all processes before any mini-batch; --baseline subtracts the group mean first.
- the PPO token clip with verl's dual clip (c 3 for A < 0), eps 0.2; a token mean over the optimizer batch (verl's
  loss_agg_mode token-mean); the KL is in the reward, not the loss; TIS / MIS multiply each token's term.
- departures: the KL uses the sampler's log-probs (verl: the trainer's old_logp, the same weights); tool-output
  tokens (mask 0) are cut out of the returns (verl's loop restarts the return at them); no log-ratio clamp at 20.

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
from common.logprobs import completion_logprobs
from common.offpolicy import importance_weights
from common.run import end_step, finish, launch, progress_bar, setup
from common.sampling import current_logprobs, old_and_reference_logprobs, sample_batch
from common.update import backward_share, masked_mean, microbatches, minibatches, save_dumps, sum_over_processes, take


@dataclass
class Args(TrainArgs):
    """The estimator's flags. The run's, the model's, the data's, the rollouts' and the optimisation's are
    TrainArgs' (common/args.py); --help lists them all."""

    exp_name: str = arg(os.path.basename(__file__)[: -len(".py")], "name of this experiment")
    # Algorithm-specific
    beta: float = arg(0.01, "KL coefficient, a k1 penalty in each token's reward (OpenRLHF's init_kl_coef)", at_least=0)
    epsilon: float = arg(0.2, "lower clip range (verl's clip_ratio, OpenRLHF's eps_clip)", at_least=0)
    epsilon_high: float = arg(0.2, "upper clip range", at_least=0)
    clip_ratio_c: float = arg(3.0, "dual clip: a token with A < 0 loses at most c |A| (verl's clip_ratio_c)",
                              at_least=1)
    baseline: bool = arg(False, "REINFORCE++-baseline: subtract the group mean reward before whitening (verl)")


# ALGO LOGIC: advantages and loss
def compute_advantages(rewards: torch.Tensor, args: Args, kl: torch.Tensor | None = None) -> torch.Tensor:
    """The returns before whitening; rows of one prompt are contiguous. `kl` (B, T): mask * (sampler_logp -
    ref_logp), the k1 penalty of each token (None: beta is 0). (B,) without it or with --baseline, else (B, T)."""
    if args.baseline:  # REINFORCEPP: verl's reinforce_plus_plus_baseline: R'_i - mean_g R', one value per row
        if kl is not None:
            rewards = rewards - args.beta * kl.sum(-1)  # (B,)  R'_i = R_i - beta KL_i
        grouped = rewards.view(-1, args.num_generations)  # (N, G)
        return (grouped - grouped.mean(dim=1, keepdim=True)).flatten()  # (B,)
    if kl is None:
        return rewards.clone()  # (B,)  REINFORCEPP: every token's return is R_i
    return rewards[:, None] - args.beta * kl.flip(-1).cumsum(-1).flip(-1)  # (B, T)  REINFORCEPP: G_it, gamma 1


def whitening_totals(advantages: torch.Tensor, mask: torch.Tensor) -> dict:
    """Sums over this process's valid tokens that whiten() needs; main() adds them up over the processes."""
    A = (advantages if advantages.dim() == 2 else advantages[:, None]) * mask  # (B, T)
    return {"n": mask.sum().to(A.dtype), "sum_a": A.sum(), "sum_a2": (A * A).sum()}


def whiten(advantages: torch.Tensor, mask: torch.Tensor, n, sum_a, sum_a2) -> torch.Tensor:
    """verl's masked_whiten with the whole batch's sums: (A - mu) / sqrt(var + 1e-8), var unbiased; 0 off mask."""
    A = advantages if advantages.dim() == 2 else advantages[:, None].expand(mask.shape)  # (B, T)
    mean = sum_a / n.clamp(min=1)
    var = (sum_a2 / n.clamp(min=1) - mean**2).clamp(min=0) * n / (n - 1).clamp(min=1)  # Bessel's correction
    return (A - mean) * torch.rsqrt(var + 1e-8) * mask  # (B, T)


def batch_stats(current_logp, old_logp, advantages, mask, args: Args) -> tuple[dict, dict]:
    """What compute_loss needs from the whole optimizer batch when it is called per micro-batch.

    Returns (totals, per_row): totals are sums over this process's rows, which the loop adds up over the
    processes; per_row are (rows,) values, which stay with their rows. `current_logp()` gives (rows, T)
    log-probs at the current weights, without gradient, for estimators whose statistics depend on them
    (on-policy it is old_logp: no extra pass).
    """
    return {"num_tokens": mask.sum().float()}, {}  # REINFORCEPP: a token mean over the optimizer batch


def compute_loss(logp, old_logp, ref_logp, advantages, mask, args: Args, num_tokens=None, tis_weights=None):
    """PPO loss with verl's dual clip on whitened advantages (B,) or (B, T), full-batch semantics. `num_tokens`
    (default: this batch's valid tokens) is the denominator over the whole optimizer batch per micro-batch;
    `tis_weights` (B, T) multiply each token's term. The KL is in the advantages; ref_logp only feeds policy/kl."""
    mask = mask.float()  # (B, T)
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    ratio = torch.exp(logp - old_logp)  # (B, T)  r_t
    A = advantages if advantages.dim() == 2 else advantages[:, None]  # (B, T) or (B, 1)
    clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)  # (B, T)
    surrogate = torch.min(ratio * A, clipped * A)  # (B, T)  s_t
    dual = (A < 0) & (surrogate < args.clip_ratio_c * A)  # (B, T)  REINFORCEPP: verl's dual clip, no gradient
    surrogate = torch.where(dual, args.clip_ratio_c * A, surrogate)  # (B, T)
    if tis_weights is not None:
        surrogate = surrogate * tis_weights  # (B, T)
    loss = -(surrogate * mask).sum() / max(num_tokens, 1)  # REINFORCEPP: token mean over the optimizer batch

    with torch.no_grad():
        token_mean = lambda x: (x * mask).sum() / mask.sum().clamp(min=1)  # noqa: E731
        is_low = (ratio < 1 - args.epsilon) & (A < 0)  # (B, T) clipped from below (gradient zeroed)
        is_high = (ratio > 1 + args.epsilon_high) & (A > 0)  # (B, T)
        metrics = {
            "loss/policy": loss.detach(),
            "policy/ratio_mean": token_mean(ratio),
            "policy/clip_frac_low": token_mean(is_low.float()),
            "policy/clip_frac_high": token_mean(is_high.float()),
            "policy/clip_frac": token_mean((is_low | is_high).float()),
            "policy/dual_clip_frac": token_mean(dual.float()),
        }
        if args.beta > 0:
            metrics["policy/kl"] = token_mean(torch.exp(ref_logp - logp) - (ref_logp - logp) - 1)  # k3, logged
    return loss, metrics


def main(args: Args):
    run = setup(args)  # common/run.py: processes, run folder, policy (+LoRA), reference, data, optimizer, engine
    model, optimizer, scheduler, accelerator = run.model, run.optimizer, run.scheduler, run.accelerator
    progress = progress_bar(run)
    for step in progress:
        step_start, metrics = time.time(), {}

        # 1. Rollouts and rewards, with the log-probs of the weights that sample them: the behaviour policy's (old)
        # and the reference's. --rollout_lag K: the batch of step + K is sampled now, this step's was K steps ago.
        for index in run.queue.steps_to_sample(step, args.total_steps):  # [step] at lag 0
            batch = sample_batch(run, index, metrics)  # this process's rows of step `index` (common/batch.py)
            batch.old_logp, batch.ref_logp = old_and_reference_logprobs(run, batch, metrics)  # (B, T) each
            run.queue.put(batch, sampled_at=step)
        batch = run.queue.take(step)
        mask, old_logp, ref_logp = batch.mask, batch.old_logp, batch.ref_logp  # (B, T) each
        T = mask.shape[1]

        # 2. Advantages (and, for a sampler/trainer mismatch, truncated or masked importance weights)
        kl = None if ref_logp is None else mask * (batch.sampler_logp - ref_logp)  # REINFORCEPP: k1 (B, T)
        advantages = compute_advantages(batch.rewards, args, kl)  # REINFORCEPP: returns, (B,) or (B, T)
        sums = sum_over_processes(whitening_totals(advantages, mask), accelerator)  # REINFORCEPP: every process's
        advantages = whiten(advantages, mask, **sums)  # REINFORCEPP: (B, T), whitened over the whole batch
        tis_weights = None
        if args.tis_cap > 0:
            tis_weights, metrics["rollout/is_masked_frac"] = importance_weights(
                old_logp, batch.sampler_logp, mask, args.tis_cap, args.tis_mode, args.mis)  # (B, T)

        # 3. Policy updates: num_iterations passes over the batch, one optimizer step per mini-batch
        model.train()
        update_start, update_metrics, grad_norms, dumps = time.time(), [], [], []
        for _ in range(args.num_iterations):
            for mini in minibatches(run):
                # the whole optimizer batch's statistics (some at the current weights: current_logp, when called)
                current_logp = partial(current_logprobs, run, batch, mini)  # () -> (rows, T), without gradient
                totals, per_row = batch_stats(current_logp, old_logp[mini], advantages[mini], mask[mini], args)
                totals = sum_over_processes(totals, accelerator)  # sums over this process's rows -> the batch's
                dumps.append(per_row)  # --dump_stats_steps (e.g. SNIB's Figure 2)
                for micro in microbatches(run, batch, mini):
                    rows = micro - mini.start  # the micro-batch's rows within the mini-batch
                    input_ids, attention = batch.input_ids[micro], batch.attention_mask[micro]  # (b, P+T) each
                    with accelerator.accumulate(model):
                        logp, entropy = completion_logprobs(model, input_ids, attention, T, args.temperature)
                        if run.on_policy:  # these weights sampled the batch: old_logp is logp, without gradient
                            old_logp[micro] = logp.detach()
                        loss, loss_metrics = compute_loss(
                            logp, old_logp[micro], take(ref_logp, micro), advantages[micro], mask[micro], args,
                            tis_weights=take(tis_weights, micro),
                            **totals, **{k: v[rows] for k, v in per_row.items()})
                        loss_metrics["loss/policy"] = backward_share(accelerator, loss)  # a share of the batch loss
                        if accelerator.sync_gradients:  # the mini-batch's last micro-batch: the optimizer step
                            grad_norms.append(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm))
                            optimizer.step()
                            optimizer.zero_grad()
                    update_metrics.append({**loss_metrics, "policy/entropy": masked_mean(entropy, mask[micro])})
                scheduler.step()
        metrics["time/update"] = time.time() - update_start
        if args.dump_stats_steps > 0 and (step + 1) % args.dump_stats_steps == 0:
            save_dumps(run, step, dumps)

        # 4. Push the new weights to the sampler; log, evaluate and save
        end_step(run, step, step_start, batch, metrics, update_metrics, grad_norms, progress)
    return finish(run)


if __name__ == "__main__":
    launch(main, Args)  # parse the arguments, train; Ctrl-C says where to resume
