"""DRO: Direct Reward Optimization's quadratic log-ratio penalty, as Kimi k1.5 trains with it
("Offline Regularised Reinforcement Learning for Large Language Models Alignment", Richemond et al.
2024, arXiv:2405.19107; "Kimi k1.5: Scaling Reinforcement Learning with LLMs", Kimi Team 2025,
arXiv:2501.12599, section 2.3.2), in verl's form (loss_mode "dro", verl 0.9.1
`compute_policy_loss_dro`).

    A_i = R_i - mean_g R,    delta_t = logp_t - old_logp_t
    L   = -(1/n) sum_{i,t} mask * [A_i logp_t - (tau / 2) delta_t^2 - beta * kl_t],
          n: valid tokens

Kimi k1.5 regresses r - tau log Z on tau log(pi / pi_old) (the closed form of its mirror-descent
step, log Z estimated by the group's mean reward): its gradient is the policy gradient with the
mean-reward baseline less tau/2 the gradient of the squared log-ratio, which keeps a stale update
near the weights that sampled; on-policy (delta_t = 0) it is the plain policy gradient.

Differs from grpo.py (verl 0.9.1 `compute_policy_loss_dro`, `policy_loss.dro_beta`):
- no ratio, no clip: A_i logp_t on every token, the trust region being the quadratic penalty
  (tau/2) (logp_t - old_logp_t)^2 per token (verl's token form; Kimi writes it on the whole
  completion's log-ratio); tau 0.05 (verl requires one and sets none; 0.05 is its own test's).
- advantage: Kimi's, the reward less its group's mean, no std (verl's grpo estimator with
  norm_adv_by_std_in_grpo False).
- a token mean over the optimizer batch (verl's loss_agg_mode token-mean); beta 0 (k3 if set).
- TIS / MIS weights multiply the policy term only; verl's rollout_is_weights also scale the
  quadratic term.

One step, in the order main() runs it, and the files it calls into (benchmarks/step_path.py lists
their functions): the rollouts, through the lagged queue (common/sampling.py, with transformers'
sampler of common/engines/rollout.py and the rewards of common/tasks/rewards.py, the toy's among
them); compute_advantages; the mini- and micro-batches (common/sampling.py again), their log-probs
(common/logprobs.py), batch_stats and compute_loss; the backward and the optimizer step, here.

Run:
    python dro.py --preset toy                                   # CPU, minutes
    accelerate launch dro.py --model Qwen/Qwen3-4B --dataset gsm8k
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
    beta: float = arg(0.0, "KL coefficient to the reference policy "
                           "(k3 estimator; verl's use_kl_loss off)", at_least=0)
    tau: float = arg(0.05, "coefficient of (1/2) (logp - old_logp)^2 per token (Kimi k1.5's tau, "
                     "verl's dro_beta; 0: none, which verl refuses); under --rollout_lag raise it "
                     "(0.5 held the toy at lag 2: docs/estimators/dro.md)", at_least=0)


# ALGO LOGIC: advantages and loss
def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """DRO: Kimi k1.5's advantage, the reward less its group's mean (no std); rows of one prompt
    are contiguous."""
    grouped = rewards.view(-1, args.num_generations)  # (N, G)
    return (grouped - grouped.mean(dim=1, keepdim=True)).flatten()  # (B,)


@dataclass
class Stats(BatchStats):
    """The loss's denominators over the whole optimizer batch (every process's rows)."""

    num_tokens: torch.Tensor  # ()  valid tokens  DRO: a token mean over the optimizer batch


def batch_stats(advantages, mask, args: Args, total=lambda x: x) -> Stats:
    """What compute_loss needs from the whole optimizer batch when it is called per micro-batch.
    `total` sums a tensor over the processes (the loop's all-reduce; alone, the identity)."""
    return Stats(num_tokens=total(mask.sum().float()))


def compute_loss(logp, old_logp, ref_logp, advantages, mask, args: Args, stats=None,
                 tis_weights=None):
    """DRO loss with full-batch semantics. `stats.num_tokens` (default: these rows' valid tokens)
    is the denominator over the whole optimizer batch per micro-batch; `tis_weights` (B, T) multiply
    the policy term per token."""
    if stats is None:
        stats = batch_stats(advantages, mask, args)
    mask = mask.float()  # (B, T)
    log_ratio = logp - old_logp  # (B, T)  DRO: delta_t
    A = advantages[:, None]  # (B, 1)
    surrogate = A * logp  # (B, T)  DRO: A_i logp_t, no ratio, no clip
    if tis_weights is not None:
        surrogate = surrogate * tis_weights  # (B, T)
    per_token = surrogate - 0.5 * args.tau * log_ratio**2  # (B, T)  DRO: the quadratic penalty
    if args.beta > 0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # (B, T)  k3
        per_token = per_token - args.beta * kl  # (B, T)
    # DRO: token mean over the optimizer batch
    loss = -(per_token * mask).sum() / stats.num_tokens.clamp(min=1)

    with torch.no_grad():
        metrics = {
            "loss/policy": loss.detach(),
            "policy/ratio_mean": masked_mean(torch.exp(log_ratio), mask),
            "dro/squared_log_ratio": masked_mean(log_ratio**2, mask),  # DRO: what tau penalises
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
