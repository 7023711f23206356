"""VESPO: "Variational Sequence-Level Soft Policy Optimization for Stable Off-Policy LLM Training"
(Shen et al. 2026, Xiaohongshu, arXiv:2602.10693).

    A_i = (R_i - mean_g R) / (std_g R + 1e-6),    delta_t = logp_t - old_logp_t
    log w_i = clamp(sum_t mask * clamp(delta_t, -20, 20), log 1e-8, 20)
    phi_i = exp(lambda_i + k_i log w_i - lambda_i w_i)   (phi(1) = 1; k, lambda by the sign of A_i)
    L   = -(1/n) sum_{i,t} mask * [sg(phi_i) A_i logp_t - beta * kl_t],   n: valid tokens

Differs from grpo.py (the authors' code, FloyedShen/VESPO recipe/vespo/code/core_algos.py, and
TRL 1.16's loss_type="vespo"):
- no ratio in the graph and no clip: one detached weight per completion, the gamma kernel phi of
  its sequence ratio w_i (the product of the token ratios, not their geometric mean), on the
  score function; (k, lambda) = (2, 3) for A_i >= 0 and (3, 2) for A_i < 0; beta 0; a token mean
  over the batch; no ablation switches.
- TIS / MIS weights do not multiply the loss: their logs (each clamped to [log 1e-8, 20]) join
  log w_i, as the authors' rollout_is_weights and TRL's importance_sampling_ratio do; a masked
  weight (0) leaves phi_i ~ e^lambda 1e-8^k, not 0. --tis_mode sequence adds the row's log weight
  once (TRL refuses sequence modes for VESPO). The k3 KL (--beta > 0) joins the token mean (TRL).
- from TRL's code: the z-score's 1e-6 is the authors' (verl's; TRL 1e-4); TIS weights are 0 at
  padding here (TRL: 1), so their logs are summed over valid tokens only (the authors' mask).

One step, in the order main() runs it, and the files it calls into (benchmarks/step_path.py lists
their functions): the rollouts, through the lagged queue (common/sampling.py, with transformers'
sampler of common/engines/rollout.py and the rewards of common/tasks/rewards.py, the toy's among
them); compute_advantages; the mini- and micro-batches (common/sampling.py again), their log-probs
(common/logprobs.py), batch_stats and compute_loss; the backward and the optimizer step, here.

Run:
    python vespo.py --preset toy                                 # CPU, minutes
    accelerate launch vespo.py --model Qwen/Qwen3-4B --dataset gsm8k
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
    beta: float = arg(0.0, "KL coefficient to the reference policy (k3 estimator)", at_least=0)
    k_pos: float = arg(2.0, "gamma kernel's shape k for A >= 0 (the authors', TRL's)", at_least=0)
    lambda_pos: float = arg(3.0, "gamma kernel's rate lambda for A >= 0 (the authors')", at_least=0)
    k_neg: float = arg(3.0, "gamma kernel's shape k for A < 0 (the authors', TRL's)", at_least=0)
    lambda_neg: float = arg(2.0, "gamma kernel's rate lambda for A < 0 (the authors')", at_least=0)


# ALGO LOGIC: advantages and loss
def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """Group-normalised advantages; rows of one prompt are contiguous."""
    grouped = rewards.view(-1, args.num_generations)  # (N, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (N, G)
    return (centered / (grouped.std(dim=1, keepdim=True) + 1e-6)).flatten()  # (B,)


@dataclass
class Stats(BatchStats):
    """The loss's denominators over the whole optimizer batch (every process's rows)."""

    num_tokens: torch.Tensor  # ()  valid tokens  VESPO: a token mean over the optimizer batch


def batch_stats(advantages, mask, args: Args, total=lambda x: x) -> Stats:
    """What compute_loss needs from the whole optimizer batch when it is called per micro-batch.
    `total` sums a tensor over the processes (the loop's all-reduce; alone, the identity)."""
    return Stats(num_tokens=total(mask.sum().float()))


LOG_W_MIN = -18.420680743952367  # log(1e-8): the authors' floor on w and on each TIS weight


def gamma_weights(log_ratio, advantages, mask, args: Args, tis_weights=None):
    """(B,) phi(w_i) = exp(lambda + k log w_i - lambda w_i), no gradient (TRL get_gamma_weights),
    and (B,) log w_i: the clamped token log-ratios' sum plus the TIS / MIS weights' logs."""
    log_ratio = log_ratio.detach().clamp(-20.0, 20.0)  # (B, T)
    log_w = (log_ratio * mask).sum(-1)  # (B,)  log prod_t r_t
    if tis_weights is not None:
        log_tis = torch.log(tis_weights).clamp(LOG_W_MIN, 20.0) * mask  # (B, T)
        row_log_tis = log_tis.sum(-1)  # (B,)  token mode: log prod_t rho_t
        if args.tis_mode == "sequence":  # the row's weight sits on each of its tokens: once
            row_log_tis = row_log_tis / mask.sum(-1).clamp(min=1)  # (B,)
        log_w = log_w + row_log_tis  # (B,)  log pi / pi_sampler
    log_w = log_w.clamp(LOG_W_MIN, 20.0)  # (B,)
    nonneg = advantages >= 0  # (B,)
    k = torch.where(nonneg, advantages.new_tensor(args.k_pos), advantages.new_tensor(args.k_neg))
    lam = torch.where(nonneg, advantages.new_tensor(args.lambda_pos),
                      advantages.new_tensor(args.lambda_neg)).clamp(min=1e-4)  # (B,)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))  # (B,)
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0), log_w  # (B,), (B,)


def compute_loss(logp, old_logp, ref_logp, advantages, mask, args: Args, stats=None,
                 tis_weights=None):
    """VESPO loss with full-batch semantics. `stats.num_tokens` (default: these rows' valid tokens)
    is the denominator over the whole optimizer batch per micro-batch; `tis_weights` (B, T) join the
    sequence ratio w_i in log space (they multiply no term)."""
    if stats is None:
        stats = batch_stats(advantages, mask, args)
    mask = mask.float()  # (B, T)
    phi, log_w = gamma_weights(logp - old_logp, advantages, mask, args, tis_weights)  # (B,), (B,)
    A = advantages[:, None]  # (B, 1)
    # (B, T)  VESPO: gradient phi(w_i) A_i grad logp_t on every token
    surrogate = phi[:, None] * A * logp
    per_token = surrogate  # (B, T)
    if args.beta > 0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # (B, T)  k3
        per_token = per_token - args.beta * kl  # (B, T)
    loss = -(per_token * mask).sum() / stats.num_tokens.clamp(min=1)  # VESPO: token mean

    with torch.no_grad():
        rows = (mask.sum(-1) > 0).float()  # (B,)  rows with a valid token
        kept_phi = phi[rows > 0]  # (b,)
        if kept_phi.numel() == 0:  # every row removed
            kept_phi = phi.new_zeros(1)  # (1,)
        metrics = {
            "loss/policy": loss.detach(),
            "vespo/phi_mean": masked_mean(phi, rows),
            "vespo/phi_min": kept_phi.min(),
            "vespo/phi_max": kept_phi.max(),
            "vespo/log_w_mean": masked_mean(log_w, rows),
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
