"""SDPO: Self-Distillation Policy Optimization ("Reinforcement Learning via Self-Distillation",
Hübotter et al. 2026, arXiv:2601.20802), in TRL 1.16's sampled-token form (trl.experimental.sdpo).

    q_t  = log pi_teacher(y_t | x'_i, y_<t),    w_t = min(exp(logp_t - old_logp_t), is_clip)
    L_sd = (1/B) sum_i (1/L'_i) sum_t mask'_it sg(w_t) sg(logp_t - q_t) logp_t
    L    = -(1/B) sum_i (1/L_i) sum_t mask [(1 - lam) s_t - beta kl_t] + lam L_sd   (s_t: GRPO's)

Differs from grpo.py:
- a self-teacher, the policy (--teacher live), its first weights (base) or their EMA (ema), scores
  the sampled tokens on x'_i, once per micro-batch; sg(logp_t - q_t) logp_t has the gradient of the
  sampled-token reverse KL. x'_i: the prompt with the first other success of its group (reward >=
  --success_threshold) and the row's --feedback_column text, where named; a row with neither keeps
  its prompt and has mask'_i = 0 (TRL's rule).
- lam = --distillation_weight 1 (the paper's, TRL's): the distillation term alone; beta 0.

One step, in the order main() runs it, and the files it calls into (benchmarks/step_path.py lists
their functions): the rollouts, through the lagged queue (common/sampling.py, with transformers'
sampler of common/engines/rollout.py and the rewards of common/tasks/rewards.py, the toy's among
them); compute_advantages; the mini- and micro-batches (common/sampling.py again), their log-probs
(common/logprobs.py), batch_stats and compute_loss; the backward and the optimizer step, here.

Run:
    python sdpo.py --preset toy --distillation_weight 0.1   # CPU, minutes (the defaults: no gain)
    accelerate launch sdpo.py --model Qwen/Qwen3-4B --dataset gsm8k
"""

import os
import time
from dataclasses import dataclass, replace  # SDPO:
from functools import partial
from typing import Literal

import torch

from common.args import TrainArgs, arg
from common.logprobs import completion_logprobs, logprob_metrics
from common.models.copies import frozen_copy, move_toward  # SDPO: the teacher's weights
from common.models.placement import sharded_parameters  # SDPO:
from common.offpolicy import importance_weights
from common.run import end_step, finish, launch, progress_bar, setup
from common.sampling import (
    BatchStats,
    masked_mean,
    microbatches,
    minibatches,
    old_and_reference_logprobs,
    round_prompts,  # SDPO: the step's prompts, to re-prompt
    rows_of,
    sample_batch,
    save_dumps,
)
from common.tasks.data import format_prompt  # SDPO: the chat template, or the plain format


@dataclass
class Args(TrainArgs):
    """The estimator's flags. The run's, the model's, the data's, the rollouts' and the
    optimisation's are TrainArgs' (common/args.py); --help lists them all."""

    exp_name: str = arg(os.path.basename(__file__)[: -len(".py")], "name of this experiment")
    # Algorithm-specific
    beta: float = arg(0.0, "KL coefficient to the reference policy (k3 estimator)", at_least=0)
    epsilon: float = arg(0.2, "lower clip range of the policy term", at_least=0)
    epsilon_high: float = arg(0.2, "upper clip range of the policy term", at_least=0)
    distillation_weight: float = arg(1.0, "lam: (1 - lam) policy term + lam distillation term")
    teacher: Literal["ema", "base", "live"] = arg("ema", "the policy's EMA, its start, or itself")
    teacher_update_rate: float = arg(0.05, "EMA: teacher += rate (policy - teacher)", at_least=0)
    distillation_is_clip: float = arg(2.0, "cap of the distillation IS weight (0: off)", at_least=0)
    success_threshold: float = arg(1.0, "a completion with this reward or more is a demonstration")
    dont_reprompt_on_self_success: bool = arg(True, "a row is never its own demonstration")
    reprompt_template: str = arg("{prompt}{solution}{feedback}\n\nCorrectly solve the original "
                                 "question.\n", "the teacher's user turn")
    solution_template: str = arg("\nCorrect solution:\n\n{successful_previous_attempt}\n\n",
                                 "a demonstration, as {solution}")
    feedback_column: str = arg("", "a data column of feedback text (TRL's: privileged_context)")
    feedback_template: str = arg("\nThe following is feedback from your unsuccessful earlier "
                                 "attempt:\n\n{feedback_raw}\n\n", "the feedback, as {feedback}")
    environment_feedback_only_without_solution: bool = arg(False, "feedback only without a demo")

    def problems(self, columns: list[str] | None = None) -> list[str]:
        """Checked before anything loads: the templates name only their own fields; no
        --dynamic_sampling (its refill rounds draw prompts the re-prompting does not look up). Once
        the data loads (`columns`), before the weights: --feedback_column is one of its columns."""
        found = []
        if self.dynamic_sampling:
            found.append("--dynamic_sampling: sdpo.py re-prompts from the step's own groups")
        fields = {"reprompt_template": ("prompt", "solution", "feedback"),
                  "solution_template": ("successful_previous_attempt",),
                  "feedback_template": ("feedback_raw",)}
        for name, names in fields.items():
            try:
                getattr(self, name).format(**dict.fromkeys(names, ""))
            except (KeyError, IndexError, ValueError) as e:
                its = ", ".join(f"{{{field}}}" for field in names)
                found.append(f"--{name}: {type(e).__name__} {e} (its fields: {its})")
        if columns is not None and self.feedback_column and self.feedback_column not in columns:
            found.append(f"--feedback_column {self.feedback_column!r}: the data has no such column "
                         f"(its columns: {', '.join(columns)}); name the right one, or none")
        return found

# ALGO LOGIC: advantages and loss
def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """Group-normalised advantages; rows of one prompt are contiguous."""
    grouped = rewards.view(-1, args.num_generations)  # (N, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (N, G)
    return (centered / (grouped.std(dim=1, keepdim=True) + 1e-6)).flatten()  # (B,)


@dataclass
class Stats(BatchStats):
    """The loss's denominators over the whole optimizer batch (every process's rows)."""

    num_rows: torch.Tensor  # ()  rows with a valid token (a removed row has none)


def batch_stats(advantages, mask, args: Args, total=lambda x: x) -> Stats:
    """What compute_loss needs from the whole optimizer batch when it is called per micro-batch.
    `total` sums a tensor over the processes (the loop's all-reduce; alone, the identity)."""
    return Stats(num_rows=total((mask.sum(-1) > 0).sum().float()))


def compute_loss(logp, old_logp, ref_logp, advantages, mask, args: Args, stats=None,
                 tis_weights=None, teacher_logp=None, distill_mask=None):  # (B, T) q_t, mask'
    """SDPO loss with full-batch semantics: `stats` hold the whole optimizer batch's denominators
    when the loss is called per micro-batch (None: these rows are the whole batch). `tis_weights`
    (B, T) multiply the policy term per token (TIS or masked IS, per token or per sequence:
    common/offpolicy.py)."""
    if stats is None:
        stats = batch_stats(advantages, mask, args)
    mask = mask.float()  # (B, T)
    ratio = torch.exp(logp - old_logp)  # (B, T)  r_t
    A = advantages[:, None]  # (B, 1)
    clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)  # (B, T)
    surrogate = torch.min(ratio * A, clipped * A)  # (B, T)  s_t
    if tis_weights is not None:
        surrogate = surrogate * tis_weights  # (B, T)
    per_token = (1 - args.distillation_weight) * surrogate  # (B, T)  SDPO: the policy share
    if args.beta > 0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # (B, T)  k3
        per_token = per_token - args.beta * kl  # (B, T)
    lengths = mask.sum(-1).clamp(min=1)  # (B,)  L_i
    per_seq = (per_token * mask).sum(-1) / lengths  # (B,)  each row's token mean
    loss = -per_seq.sum() / stats.num_rows.clamp(min=1)
    if teacher_logp is not None:  # SDPO: the distillation term
        distill_mask = mask if distill_mask is None else distill_mask.float()  # (B, T)  mask'
        gap = (logp - teacher_logp).detach()  # (B, T)  logp_t - q_t
        distill = gap * logp  # (B, T)  d_t: its gradient is the sampled-token reverse KL's
        if args.distillation_is_clip > 0:
            log_ratio = (logp - old_logp).detach().clamp(-20.0, 20.0)  # (B, T)
            is_weight = torch.exp(log_ratio).clamp(max=args.distillation_is_clip)  # (B, T)  w_t
            distill = distill * is_weight  # (B, T)
        distill_lengths = distill_mask.sum(-1).clamp(min=1)  # (B,)  L'_i
        distill_seq = (distill * distill_mask).sum(-1) / distill_lengths  # (B,)
        loss_distill = distill_seq.sum() / stats.num_rows.clamp(min=1)
        loss = loss + args.distillation_weight * loss_distill

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
        if teacher_logp is not None:
            metrics["sdpo/distill_loss"] = loss_distill.detach()
            metrics["sdpo/teacher_gap"] = masked_mean(gap, distill_mask)  # logp - q over mask'
    return loss, metrics


def demonstrations(rewards, args: Args) -> list[int | None]:
    """Each row's demonstration: the first completion of its group with reward >= the threshold,
    not itself with --dont_reprompt_on_self_success; None where there is none."""
    G = args.num_generations
    success = (rewards >= args.success_threshold).tolist()  # (B,)
    own = args.dont_reprompt_on_self_success  # TRL's name
    chosen = []
    for i in range(len(success)):
        others = [j for j in range(i - i % G, i - i % G + G) if success[j] and not (own and j == i)]
        chosen.append(others[0] if others else None)
    return chosen


def teacher_contexts(run, step: int, batch, metrics: dict):
    """The teacher's batch: [left-padded re-prompted context | the same completion] (B, P'+T), and
    mask' (B, T), the mask on the rows re-prompted. Built from each row's own group (groups never
    straddle processes) and its prompt's feedback text (TRL's rule: non-blank), formatted and
    tokenized as the prompts are; a row with neither keeps its prompt. The batch of `step` holds
    round_prompts' prompts of that step."""
    args, tokenizer, G = run.args, run.tokenizer, run.args.num_generations
    rows = round_prompts(run, step, 0)[0]  # this process's prompts of the step, one per group
    completions = batch.input_ids[:, -batch.mask.shape[1]:]  # (B, T)
    tokens = [c[m.bool()] for c, m in zip(completions, batch.completion_tokens)]  # EOS included
    texts = tokenizer.batch_decode(tokens, skip_special_tokens=True)
    feedback = rows[args.feedback_column] if args.feedback_column else [None] * len(rows["prompt"])
    ids, on, told = [], [], []
    for i, j in enumerate(demonstrations(batch.rewards, args)):
        raw = feedback[i // G]  # the prompt's feedback text, or None
        only_without = args.environment_feedback_only_without_solution and j is not None
        told.append(isinstance(raw, str) and raw.strip() != "" and not only_without)
        on.append(j is not None or told[-1])
        if not on[-1]:  # the teacher sees the prompt; the row has no distillation term
            ids.append(rows["prompt_ids"][i // G])
            continue
        solution = "" if j is None else args.solution_template.format(
            successful_previous_attempt=texts[j])
        told_text = args.feedback_template.format(feedback_raw=raw) if told[-1] else ""
        prompt = rows["prompt"][i // G]  # a text, or TRL's conversation: its last turn the user's
        plain = isinstance(prompt, str)
        user = args.prompt_template.replace("{prompt}", prompt) if plain else prompt[-1]["content"]
        turn = args.reprompt_template.format(prompt=user, solution=solution, feedback=told_text)
        prompt = turn if plain else prompt[:-1] + [{**prompt[-1], "content": turn}]
        text = format_prompt(tokenizer, prompt, "{prompt}", args.system_prompt,
                             args.use_chat_template, args.enable_thinking)
        chat = args.use_chat_template and tokenizer.chat_template  # a chat template writes its BOS
        ids.append(tokenizer(text, add_special_tokens=not chat)["input_ids"])
    padded = tokenizer.pad({"input_ids": ids}, return_tensors="pt").to(completions.device)  # left
    reprompted = torch.tensor(on, device=completions.device)  # (B,)
    metrics["sdpo/reprompted_frac"] = reprompted.float().mean().item()
    metrics["sdpo/feedback_frac"] = sum(told) / len(told)  # rows given their feedback text
    return replace(batch, input_ids=torch.cat([padded["input_ids"], completions], 1),  # (B, P'+T)
                   attention_mask=torch.cat([padded["attention_mask"], batch.completion_tokens], 1),
                   mask=batch.mask * reprompted[:, None])  # (B, T)  mask'


def self_teacher(teacher, context, rows, run, metrics: dict):
    """(b, T) the self-teacher's log-probs of the sampled tokens of `rows` on their re-prompted
    context, at the policy's temperature and top-p, without gradient: a forward per micro-batch.
    A micro-batch without a re-prompted row (mask' 0: no distillation term) needs none, unless the
    weights are sharded: every forward is then a collective that every process must join."""
    args = run.args
    if not context.mask[rows].any() and not sharded_parameters(run.accelerator):
        return torch.zeros_like(context.sampler_logp[rows])  # (b, T) masked out in compute_loss
    start = time.time()
    with torch.no_grad():
        teacher_logp, _ = completion_logprobs(
            teacher, context.input_ids[rows], context.attention_mask[rows], context.mask.shape[1],
            args.temperature, top_p=args.top_p, with_entropy=False,
        )
    metrics["time/teacher"] = metrics.get("time/teacher", 0.0) + time.time() - start
    return teacher_logp


def ema_update(teacher, policy, run) -> None:
    """--teacher ema: teacher += rate (policy - teacher) after each optimizer step, as TRL's
    SyncTeacherModelCallback does (sharded weights too: common/models/copies.py); base and live:
    nothing."""
    if run.args.teacher == "ema":
        move_toward(run.accelerator, teacher, policy, run.args.teacher_update_rate)


def main(args: Args):
    # The processes, the run folder, the policy (+ LoRA), the reference, the data, the optimizer
    # and the rollout engine (common/run.py).
    run = setup(args)
    model = run.model
    optimizer = run.optimizer
    scheduler = run.scheduler
    accelerator = run.accelerator
    total = partial(accelerator.reduce, reduction="sum")  # a tensor's sum over the processes
    policy = accelerator.unwrap_model(model)  # SDPO: the self-teacher: the policy itself (live)
    teacher = policy if args.teacher == "live" else frozen_copy(run, policy)  # SDPO: or a copy
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
        context = teacher_contexts(run, step, batch, metrics)  # SDPO: the rows re-prompted, mask'

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
                        teacher_logp = self_teacher(teacher, context, rows, run, metrics)  # SDPO:
                        loss, loss_metrics = compute_loss(
                            logp, old_logp, ref_logp, advantages[rows], mask[rows], args,
                            stats=stats.for_rows(rows - mini.start),
                            tis_weights=rows_of(tis_weights, rows),
                            teacher_logp=teacher_logp, distill_mask=context.mask[rows],  # SDPO:
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
                            ema_update(teacher, policy, run)  # SDPO: --teacher ema
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
