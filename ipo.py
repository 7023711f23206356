"""IPO: Importance Policy Optimization, prime-rl's RL loss (PrimeIntellect-ai/prime-rl,
src/prime_rl/trainer/rl/loss.py `ipo_loss_fn`; its default since PR #3418, eps 0.3 and no KL
since PR #3586). The symmetric trust region on the sampled token's probability is DPPO's binary
TV ("Rethinking the Trust Region in LLM Reinforcement Learning", arXiv:2602.04879) without its
advantage sign; the optional (log r)^2 term is Kimi K2.5's ("Kimi K2.5: Visual Agentic
Intelligence", arXiv:2602.02276).

    A_i = R_i - mean_g R,    r_t = exp(logp_t - old_logp_t),    p_t = exp(logp_t)
    L   = -(1/n) sum_{i,t} mask_i * [M_t r_t A_i - kl_tau (log r_t)^2 - beta * kl_t]
    M_t = 1 where |p_t - p_old_t| <= eps, else 0,   mask_i: valid tokens of rows with A_i != 0,
    n = sum mask_i over the optimizer batch

pi_train is `logp` (the policy being trained, prime-rl's trainer_logprobs) and pi_infer is
`old_logp` (the weights that sampled, prime-rl's inference_logprobs): prime-rl has no third
log-prob, so its ratio carries the staleness and the sampler/trainer gap at once. Here
--old_logp_source sampler makes old_logp the sampler's own values, prime-rl's exact quantity; the
default (the trainer's recomputation) leaves the gap to --tis_cap / --mis / --tis_floor.

Differs from grpo.py:
- advantage: prime-rl's GRPO, the reward less its group's mean, no std; rows with A_i = 0 leave
  the loss and the token count (prime-rl's orchestrator drops them, train_sink.py
  _prune_zero_advantages).
- no clip: the unclipped ratio r_t times A_i on every token whose probability moved at most eps
  (0.3) from old_logp's, either way whatever A_i's sign; a token past eps loses its policy term.
- --kl_tau > 0 adds kl_tau (log r_t)^2 on every kept row's valid tokens, masked or not (off:
  PR #3586); --beta > 0 the k3 KL to the reference (prime-rl has none; off).
- a token mean over the optimizer batch (prime-rl's global token count).
- prime-rl's adv_tau (a scale on A, 1 by default) is left out; a masked token's log-ratio is set to
  0 before the exp (prime-rl's keep_mask * inf would give NaN; IcePop's PR #3526 does the same).
- TIS / MIS weights multiply the policy term per token, never the (log r)^2 or k3 terms.

One step, in the order main() runs it, and the files it calls into (benchmarks/step_path.py lists
their functions): the rollouts, through the lagged queue (common/sampling.py, with transformers'
sampler of common/engines/rollout.py and the rewards of common/tasks/rewards.py, the toy's among
them); compute_advantages; the mini- and micro-batches (common/sampling.py again), their log-probs
(common/logprobs.py), batch_stats and compute_loss; the backward and the optimizer step, here.

Run:
    python ipo.py --preset toy                                   # CPU, minutes
    accelerate launch ipo.py --model Qwen/Qwen3-4B --dataset gsm8k --old_logp_source sampler
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
                           "(k3 estimator; prime-rl has none)", at_least=0)
    eps: float = arg(0.3, "a token whose probability moved more than eps from old_logp's loses its "
                     "policy term (prime-rl PR #3586)", at_least=0)
    kl_tau: float = arg(0.0, "coefficient of (log r_t)^2 on every valid token (Kimi K2.5; prime-rl "
                        "PR #3586: 0)", at_least=0)


# ALGO LOGIC: advantages and loss
def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """IPO: prime-rl's GRPO advantage, the reward less its group's mean (no std); rows of one
    prompt are contiguous."""
    grouped = rewards.view(-1, args.num_generations)  # (N, G)
    return (grouped - grouped.mean(dim=1, keepdim=True)).flatten()  # (B,)


@dataclass
class Stats(BatchStats):
    """The loss's denominators over the whole optimizer batch (every process's rows)."""

    num_tokens: torch.Tensor  # ()  IPO: valid tokens of the rows with A_i != 0


def kept_tokens(advantages, mask) -> torch.Tensor:
    """(B, T) IPO: the valid tokens of rows with a nonzero advantage (prime-rl drops the others)."""
    return mask.float() * (advantages != 0).float()[:, None]  # (B, T)


def batch_stats(advantages, mask, args: Args, total=lambda x: x) -> Stats:
    """What compute_loss needs from the whole optimizer batch when it is called per micro-batch.
    `total` sums a tensor over the processes (the loop's all-reduce; alone, the identity)."""
    return Stats(num_tokens=total(kept_tokens(advantages, mask).sum()))


def compute_loss(logp, old_logp, ref_logp, advantages, mask, args: Args, stats=None,
                 tis_weights=None):
    """IPO loss with full-batch semantics. `stats.num_tokens` (default: these rows' kept tokens) is
    the denominator over the whole optimizer batch per micro-batch; `tis_weights` (B, T) multiply
    the policy term per token. pi_train = exp(logp), pi_infer = exp(old_logp) (module docstring)."""
    if stats is None:
        stats = batch_stats(advantages, mask, args)
    valid = mask.float()  # (B, T)
    mask = kept_tokens(advantages, mask)  # (B, T)  IPO: rows with A_i = 0 leave the loss
    log_ratio = logp - old_logp  # (B, T)  log r_t
    A = advantages[:, None]  # (B, 1)
    # (B, T)  IPO: |pi_train - pi_infer| on the sampled token, either sign
    moved = (torch.exp(logp.detach()) - torch.exp(old_logp)).abs()
    is_masked = moved > args.eps  # (B, T)  IPO: out of the trust region
    # (B, T)  IPO: r_t where kept; 0 before the exp where masked (no 0 * inf)
    ratio = torch.exp(torch.where(is_masked, torch.zeros_like(log_ratio), log_ratio))
    surrogate = ~is_masked * ratio * A  # (B, T)  IPO: M_t r_t A_i, unclipped
    if tis_weights is not None:
        surrogate = surrogate * tis_weights  # (B, T)
    per_token = surrogate  # (B, T)
    if args.kl_tau > 0:
        per_token = per_token - args.kl_tau * log_ratio**2  # (B, T)  IPO: Kimi K2.5's (log r_t)^2
    if args.beta > 0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # (B, T)  k3
        per_token = per_token - args.beta * kl  # (B, T)
    # IPO: token mean over the optimizer batch
    loss = -(per_token * mask).sum() / stats.num_tokens.clamp(min=1)

    with torch.no_grad():
        metrics = {
            "loss/policy": loss.detach(),
            "policy/ratio_mean": masked_mean(torch.exp(log_ratio), valid),
            "policy/clip_frac": masked_mean(is_masked.float(), valid),  # IPO: masked, either way
        }
        if args.beta > 0:
            metrics["policy/kl"] = masked_mean(kl, valid)
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
