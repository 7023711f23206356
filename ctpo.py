"""CTPO: "Rethinking Importance Sampling in LLM Policy Optimization: A Cumulative Token Perspective"
(arXiv:2605.07331).

    rho_t = exp(min(c_t, 10)),  c_t = sum_{k<=t} mask_k clamp(logp_k - old_logp_k, -20, 20)
            (gradient via logp_t only)
    L = mean_{valid i,t} [max(-A_i rho_t, -A_i exp(clamp(log rho_t, -clip_low b_t, clip_high b_t)))
                          + beta kl_t],
        b_t = p_t ** clip_power (p_t: 1-based position), and the term is capped at
        -A_i exp(clip_c b_t) when A_i < 0

Differs from grpo.py (sections 3.1, 3.3, as in the authors' released loss "cum-token-cumprod-la"):
- the ratio of token t is the prefix ratio pi(y_<=t) / pi_old(y_<=t), with a stop-gradient on the
  prefix;
- log-space clip bounds grow like p_t ** clip_power (0: fixed; Table 3); dual clip for A < 0;
- a token mean over the optimizer batch; beta 0 by default; no ablation switches of grpo.py.

One step, in the order main() runs it, and the files it calls into (benchmarks/step_path.py lists
their functions): the rollouts, through the lagged queue (common/sampling.py, with transformers'
sampler of common/engines/rollout.py and the rewards of common/tasks/rewards.py, the toy's among
them); compute_advantages; the mini- and micro-batches (common/sampling.py again), their log-probs
(common/logprobs.py), batch_stats and compute_loss; the backward and the optimizer step, here.

Run:
    python ctpo.py --preset toy                                  # CPU, minutes
    accelerate launch ctpo.py --model Qwen/Qwen3-4B --dataset gsm8k
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
    beta: float = arg(0.0, "KL coefficient to the reference policy (k3, per token)", at_least=0)
    clip_low: float = arg(
        0.025, "lower log-space bound: log rho_t >= -clip_low * p_t ** clip_power", at_least=0,
    )
    clip_high: float = arg(
        0.05, "upper log-space bound: log rho_t <= clip_high * p_t ** clip_power", at_least=0,
    )
    clip_c: float = arg(
        0.05, "dual clip for A < 0: a token's loss <= -A * exp(clip_c * p_t ** clip_power)",
        at_least=0,
    )
    clip_power: float = arg(
        0.5, "the bounds grow like p_t ** clip_power; 0: fixed (Table 3's ablation)", at_least=0,
    )


# ALGO LOGIC: advantages and loss
def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """Group-normalised advantages; rows of one prompt are contiguous."""
    grouped = rewards.view(-1, args.num_generations)  # (N, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (N, G)
    return (centered / (grouped.std(dim=1, keepdim=True) + 1e-6)).flatten()  # (B,)


@dataclass
class Stats(BatchStats):
    """The loss's denominators over the whole optimizer batch (every process's rows)."""

    num_tokens: torch.Tensor  # ()  valid tokens  CTPO: a token mean over the optimizer batch


def batch_stats(advantages, mask, args: Args, total=lambda x: x) -> Stats:
    """What compute_loss needs from the whole optimizer batch when it is called per micro-batch.
    `total` sums a tensor over the processes (the loop's all-reduce; alone, the identity)."""
    return Stats(num_tokens=total(mask.sum().float()))


# CTPO Figure 1, by position p_t: the std of c_t, the clip rate, and the rate a fixed ratio window
# has on the same rho_t.
POSITION_BUCKETS = {"pos_1-16": (1, 16), "pos_17-64": (17, 64), "pos_65-256": (65, 256),
                    "pos_257-1024": (257, 1024), "pos_1025+": (1025, torch.inf)}
# "Fixed clip: ratio in [0.5, 5]", the authors' plot_clip_rate_vs_position.py
FIG1_FIXED_WINDOW = (0.5, 5.0)


def masked_std(x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Population std of x over the entries where `where` is true (0 if there are none)."""
    n = where.sum().clamp(min=1)
    return (((x - (x * where).sum() / n) ** 2) * where).sum().div(n).sqrt()


def compute_loss(logp, old_logp, ref_logp, advantages, mask, args: Args, stats=None,
                 tis_weights=None):
    """CTPO loss with full-batch semantics (section 3). `stats.num_tokens` (default: these rows'
    valid tokens) is the denominator over the whole optimizer batch per micro-batch; `tis_weights`
    (B, T) multiply the policy term per token. c_t and p_t run over mask = 1 tokens only: tool
    output (mask 0) is context, neither counted nor a ratio."""
    if stats is None:
        stats = batch_stats(advantages, mask, args)
    mask = mask.float()  # (B, T)
    delta = torch.clamp(logp - old_logp, -20, 20)  # (B, T)  CTPO: d_t
    # (B, T)  CTPO: sg(c_t), c_t = sum_{k<=t} mask_k d_k
    cum_logratio = torch.cumsum(mask * delta, dim=-1).detach()
    # (B, T)  CTPO: log rho_t, grad via logp_t
    log_ratio = torch.clamp(cum_logratio + logp - logp.detach(), max=10)
    ratio = torch.exp(log_ratio)  # (B, T)  CTPO: rho_t
    A = advantages[:, None]  # (B, 1)
    position = torch.cumsum(mask, dim=-1)  # (B, T)  CTPO: p_t, 1-based on valid tokens
    scale = position.clamp(min=1) ** args.clip_power  # (B, T)  CTPO: b_t = p_t ** clip_power
    # (B, T)  CTPO
    clipped = torch.exp(torch.clamp(log_ratio, -args.clip_low * scale, args.clip_high * scale))
    surrogate = torch.min(ratio * A, clipped * A)  # (B, T)  -l_t = -max(l1, l2)
    # (B, T)  CTPO: dual clip, l_t <= -A exp(clip_c b_t) for A < 0
    dual = A * torch.exp(args.clip_c * scale)
    is_dual = (A < 0) & (surrogate < dual)  # (B, T)
    surrogate = torch.where(is_dual, dual, surrogate)  # (B, T)  CTPO: gradient zeroed where capped
    if tis_weights is not None:
        surrogate = surrogate * tis_weights  # (B, T)
    per_token = surrogate  # (B, T)
    if args.beta > 0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # (B, T)  k3
        per_token = per_token - args.beta * kl  # (B, T)
    # CTPO: token mean over the optimizer batch
    loss = -(per_token * mask).sum() / stats.num_tokens.clamp(min=1)

    with torch.no_grad():
        # (B, T) clipped from below (gradient zeroed)
        is_low = (log_ratio < -args.clip_low * scale) & (A < 0)
        is_high = (log_ratio > args.clip_high * scale) & (A > 0)  # (B, T)
        lo_fixed, hi_fixed = torch.tensor(FIG1_FIXED_WINDOW, dtype=torch.float64).log().tolist()
        # (B, T)  Figure 1
        is_fixed = ((log_ratio < lo_fixed) & (A < 0)) | ((log_ratio > hi_fixed) & (A > 0))
        metrics = {
            "loss/policy": loss.detach(),
            "policy/ratio_mean": masked_mean(ratio, mask),
            "policy/clip_frac_low": masked_mean(is_low.float(), mask),
            "policy/clip_frac_high": masked_mean(is_high.float(), mask),
            "policy/clip_frac": masked_mean((is_low | is_high).float(), mask),
            "policy/dual_clip_frac": masked_mean(is_dual.float(), mask),
            "policy/cum_logratio_std": masked_std(cum_logratio, mask > 0),
        }
        # The buckets the padded width T reaches (in the loop: the longest completion of this
        # process), so that every micro-batch logs the same keys; one with no token in a bucket
        # logs 0 for it.
        for name, (lo, hi) in POSITION_BUCKETS.items():
            if lo <= mask.shape[1]:
                in_bucket = (mask > 0) & (position >= lo) & (position <= hi)  # (B, T)
                metrics[f"ctpo/cum_logratio_std/{name}"] = masked_std(cum_logratio, in_bucket)
                for key, clipped_here in (("clip_frac", is_low | is_high),
                                          ("fixed_clip_frac", is_fixed)):
                    metrics[f"ctpo/{key}/{name}"] = ((clipped_here & in_bucket).sum()
                                                     / in_bucket.sum().clamp(min=1))
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
