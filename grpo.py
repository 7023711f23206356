"""GRPO: Group Relative Policy Optimization (DeepSeekMath, Shao et al. 2024, arXiv:2402.03300).

    A_i = (R_i - mean_g R) / (std_g R + 1e-6),    r_t = exp(logp_t - old_logp_t)
    L   = -(1/B) sum_i (1/L_i) sum_t mask * [min(r_t A_i, clip(r_t, 1-eps, 1+eps_high) A_i) - beta * kl_t]

Differs from DeepSeekMath's description:
- old_logp is the trainer's, not the sampler's; their gap is logged, and corrected with --tis_cap (off by default).
- the ablations of "Towards Understanding the Optimization Landscape of GRPO and its Variants": --advantage sign,
  --train_on positive|negative, --loss_agg token-sum-norm | token-mean (verl's); docs/estimators/grpo.md.

Run:
    python grpo.py --preset toy                                  # CPU, minutes
    accelerate launch grpo.py --model Qwen/Qwen3-4B --dataset gsm8k
"""

import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Literal

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
    beta: float = arg(0.04, "KL coefficient to the reference policy (k3 estimator)", at_least=0)
    epsilon: float = arg(0.2, "lower clip range", at_least=0)
    epsilon_high: float = arg(0.2, "upper clip range", at_least=0)
    advantage: Literal["zscore", "sign"] = arg("zscore", "zscore, or sign: A = sign(R - group mean) (landscape paper)")
    train_on: Literal["all", "positive", "negative"] = arg("all", "all rows, or only those with A > 0, or A < 0")
    loss_agg: Literal["seq-mean-token-mean", "token-mean", "token-sum-norm"] = arg(
        "seq-mean-token-mean", "mean over rows of token means; token-mean, token-sum-norm: docs/estimators/grpo.md")


# ALGO LOGIC: advantages and loss
def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """Group-normalised advantages; rows of one prompt are contiguous."""
    grouped = rewards.view(-1, args.num_generations)  # (N, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (N, G)
    if args.advantage == "sign":  # the landscape paper: A_i = sign(R_i - mean_g R)
        return centered.sign().flatten()  # (B,)
    return (centered / (grouped.std(dim=1, keepdim=True) + 1e-6)).flatten()  # (B,)


def batch_stats(current_logp, old_logp, advantages, mask, args: Args) -> tuple[dict, dict]:
    """What compute_loss needs from the whole optimizer batch when it is called per micro-batch.

    Returns (totals, per_row): totals are sums over this process's rows, which the loop adds up over the
    processes; per_row are (rows,) values, which stay with their rows. `current_logp()` gives (rows, T)
    log-probs at the current weights, without gradient, for estimators whose statistics depend on them
    (on-policy it is old_logp: no extra pass).
    """
    sign = {"positive": advantages > 0, "negative": advantages < 0}.get(args.train_on, True)  # (B,) PL / NL, or all
    keep = (mask.sum(-1) > 0) & sign  # (B,)  kept: a valid token (removed rows have none) and the sign
    return {"num_rows": keep.sum().float(), "num_tokens": (mask.sum(-1) * keep).sum().float()}, {}


def compute_loss(logp, old_logp, ref_logp, advantages, mask, args: Args, num_rows=None, tis_weights=None,
                 num_tokens=None):
    """GRPO loss with full-batch semantics. `num_rows` (token-mean: `num_tokens`; default: this batch's kept) is the
    denominator over the whole optimizer batch when called per micro-batch; `tis_weights` (B, T)
    multiply the policy term per token (TIS or masked IS, per token or per sequence: common.offpolicy)."""
    mask = mask.float()  # (B, T)
    sign = {"positive": advantages > 0, "negative": advantages < 0}.get(args.train_on, True)  # (B,) PL / NL, or all
    keep = ((mask.sum(-1) > 0) & sign).float()  # (B,)  kept: a valid token and the sign
    if num_rows is None:
        num_rows, num_tokens = keep.sum(), (mask.sum(-1) * keep).sum()
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
    lengths = {"token-sum-norm": args.max_completion_length, "token-mean": 1}.get(args.loss_agg, mask.sum(-1).clamp(1))
    per_seq = (per_token * mask).sum(-1) / lengths  # (B,)
    loss = -(per_seq * keep).sum() / max(num_tokens if args.loss_agg == "token-mean" else num_rows, 1)  # verl: tokens

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
        }
        if args.beta > 0:
            metrics["policy/kl"] = token_mean(kl)
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
        advantages = compute_advantages(batch.rewards, args)  # (B,)
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
