"""MaxRL: Maximum Likelihood Reinforcement Learning ("Maximum Likelihood Reinforcement Learning", Tajwar et al. 2026,
arXiv:2602.02710): the group's mean reward (its success rate) normalises the advantage in place of its std.

    A_i = (R_i - mean_g R) / (mean_g R + 1e-6)  (0 where mean_g R <= 0),   r_t = exp(logp_t - old_logp_t)
    L   = -(1/n) sum_{i,t} mask * [max(min(r_t A_i, clip(r_t, 1-eps, 1+eps_high) A_i), c A_i if A_i < 0) - beta kl_t]

With binary rewards and K successes of G: A = (G - K) / K on a success, -1 on a failure, so the gradient is
(1/K) sum_{successes} grad log pi: the maximum-likelihood gradient of the successes' share, an unbiased estimate of the
order-G truncation of the log pass rate's gradient (the paper; G = 1 is REINFORCE, G -> infinity maximum likelihood).

Differs from grpo.py (the authors' verl fork, `compute_maxrl_outcome_advantage`; prime-rl's `max_rl`):
- the group mean replaces the std: (R - mean) / (mean + 1e-6) as the authors' verl fork; 0 where mean <= 0, as
  prime-rl (for rewards >= 0 the two agree: such a group's rewards are all 0). Meant for rewards >= 0 (a pass rate).
- the rest is verl's defaults, which that fork keeps: the PPO token clip (eps 0.2) with verl's dual clip (c 3 for
  A < 0), a token mean over the optimizer batch (loss_agg_mode token-mean), no KL (beta 0; k3 in the loss if set).
- TIS / MIS multiply each token's policy term; no ablation switches.

Run:
    python maxrl.py --preset toy                                 # CPU, minutes
    accelerate launch maxrl.py --model Qwen/Qwen3-4B --dataset gsm8k
"""

import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch

from common.args import arg
from common.logprobs import completion_logprobs
from common.offpolicy import importance_weights
from common.run import end_step, finish, launch, progress_bar, setup
from common.sampling import current_logprobs, old_and_reference_logprobs, sample_batch
from common.update import backward_share, masked_mean, microbatches, minibatches, save_dumps, sum_over_processes, take


@dataclass
class Args:
    # Experiment
    exp_name: str = arg(os.path.basename(__file__)[: -len(".py")], "name of this experiment")
    seed: int = arg(1, "seed of the run (weights init of LoRA, data order, sampling)")
    preset: str | None = arg(None, "a named set of defaults: toy, toy_tir (CPU, minutes), smollm2 (a real model, CPU)")
    output_dir: str = arg("runs", "runs are written to output_dir/run_name")
    run_name: str | None = arg(None, "default: {exp_name}__{seed}__{unix time}")
    report_to: str = arg("tensorboard", "tracker: tensorboard, wandb, trackio, mlflow or none")
    save_steps: int = arg(100, "checkpoint every this many steps (0: only at the end)")
    save_total_limit: int = arg(0, "keep only the last N checkpoints (0: all)")
    resume_from: str | None = arg(None, "a checkpoint folder, or a run folder (its latest)")
    resume_overrides: str = arg("", "comma-separated settings a resume may change (others must match the run's)")
    # Model
    model: str = arg("Qwen/Qwen3-4B", "hub id or local folder of the policy")
    dtype: Literal["bfloat16", "float16", "float32"] = arg("bfloat16", "weights dtype: bfloat16, float16 or float32")
    gradient_checkpointing: bool = arg(False, "trade compute for activation memory")
    lora_r: int = arg(0, "LoRA rank; 0 trains all weights")
    lora_alpha: int = arg(32, "LoRA alpha")
    lora_target_modules: str = arg("all-linear", "comma-separated module names, or all-linear")
    # Data and rewards
    dataset: str = arg("gsm8k", "preset (gsm8k, math, numina, deepscaler), hub id or local file/folder")
    dataset_config: str | None = arg(None, "dataset configuration name (hub datasets)")
    split: str | None = arg(None, "training split (default: the preset's, else train)")
    eval_dataset: str | None = arg(None, "held-out prompts (default: --dataset)")
    eval_split: str | None = arg(None, "held-out split (default: the preset's, else test)")
    prompt_column: str | None = arg(None, "column with the question (default: the preset's, else prompt)")
    answer_column: str | None = arg(None, "column with the reference answer (default: the preset's, else answer)")
    prompt_template: str = arg("{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}.",
                               "user message; {prompt} is replaced by the question")
    system_prompt: str = arg("", "system message (chat templates only)")
    use_chat_template: bool = arg(True, "wrap prompts in the tokenizer's chat template")
    enable_thinking: bool = arg(False, "Qwen3's thinking mode in the chat template")
    reward_funcs: str = arg("math_accuracy", "comma-separated registered names or module:function")
    reward_weights: str | None = arg(None, "comma-separated weights (default: all 1)")
    reward_timeout: float = arg(600.0, "seconds one reward function may take on a batch, or the run stops", at_least=1)
    # Rollouts
    rollout_engine: Literal["auto", "vllm", "hf"] = arg("auto", "vllm, hf (transformers' generate) or auto")
    max_prompt_length: int = arg(512, "longer prompts are dropped from the data")
    max_completion_length: int = arg(1024, "tokens generated per completion at most")
    temperature: float = arg(1.0, "sampling temperature (the policy is softmax(logits / T))")
    top_p: float = arg(1.0, "nucleus sampling")
    vllm_gpu_memory_utilization: float = arg(0.3, "GPU memory fraction vLLM may take")
    vllm_tensor_parallel_size: int = arg(1, "GPUs per vLLM engine (consecutive ranks)")
    server_url: str | None = arg(None, "rollouts from a server (python -m common.serve) at http://HOST:PORT")
    server_timeout: float = arg(600.0, "seconds a request to the server may wait for its answer", at_least=1)
    tis_cap: float = arg(0.0, "importance sampling cap for sampler/trainer mismatch; 0: off")
    tis_mode: Literal["token", "sequence"] = arg("token", "--tis_cap on each token's ratio or each completion's")
    mis: bool = arg(False, "masked IS: a ratio above --tis_cap gets weight 0, not the cap (token or completion)")
    old_logp_source: Literal["trainer", "sampler"] = arg("trainer", "old_logp from a trainer pass, or the sampler's")
    max_logp_gap: float = arg(0.5, "stop when rollout/logp_gap_mean exceeds this (a failed weight push); 0: off")
    max_turns: int = arg(1, "model turns per completion; > 1: tool calls run in a sandbox between turns")
    tool: str = arg("simpletir", "with --max_turns > 1: simpletir (Python code blocks) or toy (a calculator)")
    rollout_lag: int = arg(0, "K: the batch trained at step s was sampled by the weights of step s - K")
    dynamic_sampling: bool = arg(False, "DAPO: replace groups of equal rewards by groups of new prompts")
    max_refill_rounds: int = arg(4, "dynamic sampling: extra rounds at most; slots still empty leave the loss")
    mask_truncated: bool = arg(False, "completions cut at max_completion_length leave the loss (DAPO)")
    overlong_buffer: int = arg(0, "DAPO's soft overlong penalty over the last N tokens before the limit; 0: off")
    overlong_penalty: float = arg(1.0, "the overlong reward term at max_completion_length: -overlong_penalty")
    # Optimisation
    total_steps: int = arg(500, "RL steps (one batch of rollouts each)")
    batch_size: int = arg(256, "completions per step over all processes: B = prompts x G")
    num_generations: int = arg(8, "completions per prompt, G")
    mini_batch_size: int = arg(0, "completions per optimizer step over all processes; 0: batch_size")
    micro_batch_size: int = arg(4, "completions per forward/backward on each process")
    logprob_batch_size: int = arg(0, "completions per no-grad forward on each process; 0: micro_batch_size")
    num_iterations: int = arg(1, "passes over each batch of rollouts (mu)")
    learning_rate: float = arg(1e-6, "AdamW learning rate")
    lr_scheduler_type: str = arg("constant", "transformers scheduler name")
    warmup_steps: int = arg(0, "learning-rate warmup in optimizer steps")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient clipping")
    eval_steps: int = arg(50, "held-out greedy accuracy every this many steps (0: off)")
    eval_num_prompts: int = arg(500, "held-out prompts per evaluation")
    eval_benchmarks: str = arg("", "benchmarks to evaluate, e.g. math500,aime25 (NAME=FILE: a local copy)")
    eval_num_samples: int = arg(1, "samples per benchmark question, k of avg@k (1: greedy)")
    dump_stats_steps: int = arg(0, "save batch_stats' per-row tensors to run_dir/stats every this many steps (0: off)")
    # Algorithm-specific
    beta: float = arg(0.0, "KL coefficient to the reference policy (k3 estimator; verl's use_kl_loss off)", at_least=0)
    epsilon: float = arg(0.2, "lower clip range (verl's clip_ratio)", at_least=0)
    epsilon_high: float = arg(0.2, "upper clip range", at_least=0)
    clip_ratio_c: float = arg(3.0, "dual clip: a token with A < 0 loses at most c |A| (verl's clip_ratio_c)",
                              at_least=1)


# ALGO LOGIC: advantages and loss
def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """Mean-normalised advantages (the group's success rate in place of its std); rows of one prompt are contiguous."""
    grouped = rewards.view(-1, args.num_generations)  # (N, G)
    mean = grouped.mean(dim=1, keepdim=True)  # (N, 1)  MAXRL: p_hat, the group's pass rate
    A = (grouped - mean) / (mean + 1e-6)  # (N, G)  MAXRL: (R_i - p_hat) / p_hat
    return torch.where(mean > 0, A, torch.zeros_like(A)).flatten()  # (B,)  MAXRL: no success, no signal


def batch_stats(current_logp, old_logp, advantages, mask, args: Args) -> tuple[dict, dict]:
    """What compute_loss needs from the whole optimizer batch when it is called per micro-batch.

    Returns (totals, per_row): totals are sums over this process's rows, which the loop adds up over the
    processes; per_row are (rows,) values, which stay with their rows. `current_logp()` gives (rows, T)
    log-probs at the current weights, without gradient, for estimators whose statistics depend on them
    (on-policy it is old_logp: no extra pass).
    """
    return {"num_tokens": mask.sum().float()}, {}  # MAXRL: a token mean over the optimizer batch (verl's)


def compute_loss(logp, old_logp, ref_logp, advantages, mask, args: Args, num_tokens=None, tis_weights=None):
    """MaxRL loss (verl's PPO loss with its dual clip) with full-batch semantics. `num_tokens` (default: this
    batch's valid tokens) is the denominator over the whole optimizer batch per micro-batch; `tis_weights` (B, T)
    multiply the policy term per token."""
    mask = mask.float()  # (B, T)
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    ratio = torch.exp(logp - old_logp)  # (B, T)  r_t
    A = advantages[:, None]  # (B, 1)
    clipped = torch.clamp(ratio, 1 - args.epsilon, 1 + args.epsilon_high)  # (B, T)
    surrogate = torch.min(ratio * A, clipped * A)  # (B, T)  s_t
    dual = (A < 0) & (surrogate < args.clip_ratio_c * A)  # (B, T)  MAXRL: verl's dual clip, no gradient
    surrogate = torch.where(dual, args.clip_ratio_c * A, surrogate)  # (B, T)
    if tis_weights is not None:
        surrogate = surrogate * tis_weights  # (B, T)
    per_token = surrogate  # (B, T)
    if args.beta > 0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # (B, T)  k3
        per_token = per_token - args.beta * kl  # (B, T)
    loss = -(per_token * mask).sum() / max(num_tokens, 1)  # MAXRL: token mean over the optimizer batch

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
