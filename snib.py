"""SNIB: "Principled Policy Optimization for LLMs via Self-Normalized Importance Sampling" (under
review, no arXiv id).

    A_i = R_i - mean_g R,   u_i = sum_t mask (logp - old_logp)
    w_i = exp(u_i - sg(log mean_{j in g} exp(u_j)))
    L   = -(1/B) sum_i [min(w_i A_i, clip(w_i, 1-eps, 1+eps) A_i)
                        - beta * w_i * (1/L_i) sum_t mask * kl_t]

Differs from grpo.py (the paper's section 3 and Algorithm 1):
- one weight per completion, its sequence ratio (EOS included) over its group's mean (in [0, G],
  mean 1); baseline-only advantages; symmetric clip; IS-weighted KL; sequence TIS. Ablations (Table
  5, Figure 1a): --self_normalize false (Vanilla IS), --stop_grad_norm false (SNIB-fg), --baseline
  false, --adv_std (z-score), --reward_noise SIGMA.

One step, in the order main() runs it, and the files it calls into (benchmarks/step_path.py lists
their functions): the rollouts, through the lagged queue (common/sampling.py, with transformers'
sampler of common/engines/rollout.py and the rewards of common/tasks/rewards.py, the toy's among
them); compute_advantages; the mini- and micro-batches (common/sampling.py again), their log-probs
(common/logprobs.py), batch_stats and compute_loss; the backward and the optimizer step, here.

Run:
    python snib.py --preset toy                                  # CPU, minutes
    accelerate launch snib.py --model Qwen/Qwen3-4B --dataset gsm8k
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
    log_ratio_now,  # SNIB:
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
        0.1, "KL coefficient to the reference policy (k3, IS-weighted per sequence)", at_least=0,
    )
    epsilon: float = arg(
        0.2, "clip range of the sequence weight: clip(w, 1-eps, 1+eps)", at_least=0,
    )
    self_normalize: bool = arg(True, "divide w by its group mean; false: Vanilla IS, w = exp(u)")
    stop_grad_norm: bool = arg(True, "no gradient through the group mean (SNIB-sg); false: SNIB-fg")
    baseline: bool = arg(True, "subtract the group mean reward; false: A_i = R_i")
    adv_std: bool = arg(False, "also divide by the group reward std (z-score, migration guide)")
    reward_noise: float = arg(
        0.0, "std of Gaussian noise added to rewards (Figure 1a robustness study)", at_least=0,
    )
    kl_weight_grad: bool = arg(True, "the KL term w_i K_i keeps w_i's gradient; false: sg(w_i) K_i")

    def problems(self, columns: list[str] | None = None) -> list[str]:
        """Checked before anything loads: SNIB-fg with a KL term or TIS needs whole groups in a
        micro-batch (wbar_in_graph)."""
        if wbar_in_graph(self) and self.micro_batch_size % self.num_generations:
            G = self.num_generations
            return [f"--micro_batch_size {self.micro_batch_size}: SNIB-fg (--stop_grad_norm false) "
                    f"with a KL term or TIS takes each group's mean weight from a micro-batch's "
                    f"own rows, so it needs a multiple of --num_generations {G}, e.g. "
                    f"--micro_batch_size {G}"]
        return []


# ALGO LOGIC: advantages and loss
def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """Group-normalised advantages; rows of one prompt are contiguous."""
    # SNIB: R_i + N(0, sigma^2); global RNG (set_seed, restored on resume) + rank
    if args.reward_noise > 0:
        from accelerate import PartialState
        seed = int(torch.randint(2**62, ())) + PartialState().process_index
        rank_rng = torch.Generator().manual_seed(seed)
        noise = torch.randn(rewards.shape, generator=rank_rng).to(rewards)  # (B,)
        rewards = rewards + args.reward_noise * noise  # (B,)
    grouped = rewards.view(-1, args.num_generations)  # (N, G)
    # (N, G)  SNIB: or R_i
    centered = grouped - grouped.mean(dim=1, keepdim=True) if args.baseline else grouped
    if not args.adv_std:  # SNIB: baseline only
        return centered.flatten()  # (B,)
    return (centered / (grouped.std(dim=1, keepdim=True) + 1e-6)).flatten()  # (B,)


@dataclass
class Stats(BatchStats):
    """What SNIB's loss needs from the whole optimizer batch: its rows, and for each row its group's
    statistics at the current weights (a group lies whole on one process)."""

    num_rows: torch.Tensor  # ()  rows with a valid token, over every process
    log_weight: torch.Tensor = BatchStats.per_row()  # (B,)  u_i (--dump_stats_steps: Figure 2)
    log_wbar: torch.Tensor = BatchStats.per_row()  # (B,)  log wbar_g, the group's mean weight
    fg_coeff: torch.Tensor = BatchStats.per_row()  # (B,)  C_g / n_g, SNIB-fg's gradient via wbar_g
    group_ess: torch.Tensor = BatchStats.per_row()  # (B,)  (sum_g w)^2 / (n_g sum_g w^2)


def group_mean(x: torch.Tensor, n_g: torch.Tensor, G: int) -> torch.Tensor:
    """(B,) -> (B,): each row gets its group's sum over n_g, the group's rows left in the loss."""
    return (x.view(-1, G).sum(1) / n_g).repeat_interleave(G)


def batch_stats(log_ratio, advantages, mask, args: Args, total=lambda x: x) -> Stats:
    """What compute_loss needs from the whole optimizer batch when it is called per micro-batch.
    `log_ratio` (B, T): logp - old_logp at the current weights; `total` sums a tensor over the
    processes."""
    G, A = args.num_generations, advantages  # (B,)
    # (N, G)  removed rows (no valid token) leave wbar_g: G becomes n_g
    kept = (mask.sum(-1) > 0).view(-1, G)
    u = (log_ratio * mask).sum(-1)  # (B,)  SNIB: u_i at the current weights
    n_g = kept.sum(1).clamp(min=1).to(u.dtype)  # (N,)
    u_g = u.view(-1, G).masked_fill(~kept, -torch.inf)  # (N, G)
    u_g = torch.where(kept.any(1, keepdim=True), u_g, 0.0)  # (N, G)  a group with no row left: 0
    log_wbar = (torch.logsumexp(u_g, dim=1) - n_g.log()).repeat_interleave(G)  # (B,)  log wbar_g
    w = torch.exp(u - log_wbar) * kept.flatten()  # (B,)  w_i, 0 on removed rows
    # (B,)  the min picks w_i A_i
    unclipped = w * A <= torch.clamp(w, 1 - args.epsilon, 1 + args.epsilon) * A
    # SNIB-fg's gradient through wbar_g: C_g / n_g, where
    # C_g = sum_k w_k d(-min(w_k A_k, clip(w_k) A_k)) / dw_k
    fg_coeff = group_mean(-A * unclipped * w, n_g, G)  # (B,)
    group_ess = group_mean(w, n_g, G) ** 2 / group_mean(w**2, n_g, G).clamp(min=1e-30)  # (B,)
    num_rows = total(kept.sum().float())  # ()
    return Stats(num_rows, log_weight=u, log_wbar=log_wbar, fg_coeff=fg_coeff, group_ess=group_ess)


def wbar_in_graph(args: Args) -> bool:
    """SNIB-fg with a KL term or TIS: compute_loss takes wbar_g from the micro-batch's own rows, in
    the graph, so a micro-batch must hold whole groups."""
    return args.self_normalize and not args.stop_grad_norm and (args.beta > 0 or args.tis_cap > 0)


def compute_loss(logp, old_logp, ref_logp, advantages, mask, args: Args, stats=None,
                 tis_weights=None):
    """SNIB loss with full-batch semantics: sg(log wbar_g) is `stats.log_wbar` (None: these rows are
    the whole batch). SNIB-fg adds the gradient through wbar as -(1/B) C_g sum_{j in g} (w_j / n_g)
    du_j with value 0 (docs/estimators/snib.md); with a KL term or TIS, it takes wbar_g in the graph
    instead."""
    if stats is None:
        stats = batch_stats(logp.detach() - old_logp, advantages, mask, args)
    G = args.num_generations
    mask = mask.float()  # (B, T)
    fg = args.self_normalize and not args.stop_grad_norm  # SNIB-fg: the gradient through wbar_g too
    log_wbar, fg_coeff = stats.log_wbar, stats.fg_coeff  # (B,) each
    # (B,)  SNIB: u_i = sum_t mask (logp - old_logp), EOS included
    u = ((logp - old_logp) * mask).sum(-1)
    if fg and (args.beta > 0 or tis_weights is not None):  # whole groups, in order (wbar_in_graph)
        if u.numel() % G:
            raise ValueError("SNIB-fg with --beta > 0 or --tis_cap > 0 needs --micro_batch_size a "
                             "multiple of G")
        # (B,)  in the graph
        log_wbar = batch_stats(logp - old_logp, advantages, mask, args).log_wbar
        fg_coeff = None
    if args.self_normalize:
        w = torch.exp(u - (log_wbar if fg else log_wbar.detach()))  # (B,)  SNIB: in [0, G]
    else:
        w = torch.exp(u)  # (B,)  Vanilla IS
    per_seq = torch.min(w * advantages,
                        torch.clamp(w, 1 - args.epsilon, 1 + args.epsilon) * advantages)  # (B,)
    kept = mask.sum(-1) > 0  # (B,)  SNIB: removed rows leave the loss
    per_seq = per_seq * kept  # (B,)
    w = w * kept  # (B,)
    lengths = mask.sum(-1).clamp(min=1)  # (B,)  L_i
    if tis_weights is not None:
        per_seq = per_seq * (tis_weights * mask).sum(-1) / lengths  # (B,)  SNIB: sequence-level TIS
    if args.beta > 0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # (B, T)  k3
        kl_weight = w if args.kl_weight_grad else w.detach()  # (B,)  SNIB: the KL is IS-weighted
        per_seq -= args.beta * kl_weight * (kl * mask).sum(-1) / lengths  # (B,)
    if fg and fg_coeff is not None:
        # (B,)  value 0, gradient C_g w_i / n_g du_i
        per_seq = per_seq + fg_coeff * w.detach() * (u - u.detach())
    loss = -per_seq.sum() / stats.num_rows

    with torch.no_grad():
        # (B,)  clipped from below (gradient zeroed)
        is_low = (w < 1 - args.epsilon) & (advantages < 0)
        is_high = (w > 1 + args.epsilon) & (advantages > 0)  # (B,)
        metrics = {
            "loss/policy": loss.detach(),
            "snib/weight_mean": w.sum() / kept.sum().clamp(min=1),
            "snib/weight_max": w.max(),
            "snib/raw_logweight_std": u.std(correction=0),
            "snib/ess": stats.group_ess.mean(),
            "policy/clip_frac": (is_low | is_high).float().mean(),
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
                log_ratio = log_ratio_now(run, batch, mini)  # SNIB: (rows, T) at current weights
                stats = batch_stats(log_ratio, advantages[mini], mask[mini], args, total)  # SNIB:
                dumps.append(stats)  # --dump_stats_steps (e.g. SNIB's Figure 2)
                # SNIB: (b,) indices of this process's rows; whole groups if wbar_g is in the graph
                for rows in microbatches(run, batch, mini,  # SNIB:
                                         whole_groups=wbar_in_graph(args)):  # SNIB:
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
