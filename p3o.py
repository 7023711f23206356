"""P3O: Policy-on Policy-off Policy Optimization (Fakoor et al. 2019, arXiv:1905.01756) with the batch ESS of
"Trust the Batch, On- or Off-Policy: Adaptive Policy Optimization for RL Post-Training" (code: FeynRL's
algs/P3O/p3o.py, github.com/FeynRL-project/FeynRL).

    A_i = z-score,   r_t = exp(logp_t - old_logp_t),   ESS = (sum r)^2 / (n sum r^2) over the batch's n valid tokens
    L   = (1/n) sum_{i,t} mask [-sg(min(r_t, ESS)) A_i logp_t + (1-ESS) kl_old_t + beta kl_ref_t - entropy_coeff H_t]

Differs from grpo.py:
- no clip: the batch ESS caps a detached score-function weight and weighs a KL to the behaviour policy,
  kl_old_t = (logp - old_logp) + exp(clamp(old_logp - logp, -10, 10)) - 1; a token mean over the batch.
- ESS over every valid token of the optimizer batch, all processes; --ess_scope micro_batch: each micro-batch's own
  (FeynRL's choice, a departure from full-batch semantics: docs/estimators/conventions.md).

Run:
    python p3o.py --preset toy                                   # CPU, minutes
    accelerate launch p3o.py --model Qwen/Qwen3-4B --dataset gsm8k
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
    beta: float = arg(0.0, "KL coefficient to the reference policy (kl_old's estimator)", at_least=0)
    entropy_coeff: float = arg(0.0, "entropy bonus; > 0 needs the entropy with gradient", at_least=0)
    ess_scope: Literal["batch", "micro_batch"] = arg("batch", "ESS over the batch, or each micro-batch (FeynRL)")


# ALGO LOGIC: advantages and loss
def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """Group-normalised advantages; rows of one prompt are contiguous."""
    grouped = rewards.view(-1, args.num_generations)  # (N, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (N, G)
    return (centered / (grouped.std(dim=1, keepdim=True) + 1e-6)).flatten()  # (B,)


def batch_stats(current_logp, old_logp, advantages, mask, args: Args) -> tuple[dict, dict]:
    """What compute_loss needs from the whole optimizer batch when it is called per micro-batch.

    Returns (totals, per_row): totals are sums over this process's rows, which the loop adds up over the
    processes; per_row are (rows,) values, which stay with their rows. `current_logp()` gives (rows, T)
    log-probs at the current weights, without gradient, for estimators whose statistics depend on them
    (on-policy it is old_logp: no extra pass).
    """
    # P3O: ESS needs sum r, sum r^2 and n over every valid token of the optimizer batch, at the current weights;
    # --ess_scope micro_batch leaves them to each micro-batch's own forward and keeps the batch's token count
    if args.ess_scope == "micro_batch":
        return {"num_tokens": mask.double().sum()}, {}
    return ess_sums(current_logp(), old_logp, mask), {}


def ess_sums(current_logp, old_logp, mask) -> dict[str, torch.Tensor]:
    """sum r, sum r^2 and n over the valid tokens of these rows: ESS = (sum r)^2 / (n sum r^2)."""
    delta = (current_logp - old_logp).double().masked_fill(mask == 0, 0)  # (B, T)  float64: r^2 overflows fp32
    ratio = torch.exp(delta) * mask  # (B, T)  r_t on valid tokens, 0 on padding
    return {"sum_r": ratio.sum(), "sum_r2": (ratio**2).sum(), "num_tokens": mask.double().sum()}


def compute_loss(logp, old_logp, ref_logp, advantages, mask, args: Args, sum_r=None, sum_r2=None, num_tokens=None,
                 tis_weights=None, entropy=None):
    """P3O loss with full-batch semantics: `sum_r`, `sum_r2`, `num_tokens` (default: this batch's) are the optimizer
    batch's sums over valid tokens at the current weights; `tis_weights` (B, T) scale the policy term, not the trust
    region; `entropy` (B, T) carries its gradient when entropy_coeff > 0."""
    if args.entropy_coeff > 0 and (entropy is None or (logp.requires_grad and not entropy.requires_grad)):
        raise ValueError("--entropy_coeff > 0 needs the entropy's gradient: completion_logprobs(entropy_grad=True)")
    own = ess_sums(logp.detach(), old_logp, mask) if sum_r is None else dict(
        sum_r=sum_r, sum_r2=sum_r2, num_tokens=num_tokens)  # the batch's, or these rows' own
    num_tokens = own["num_tokens"] if num_tokens is None else num_tokens  # the token mean's denominator
    mask = mask.float()  # (B, T)
    ess = (own["sum_r"]**2 / (own["num_tokens"] * own["sum_r2"]).clamp(1e-300)).to(logp.dtype)  # ()  P3O: 0 if no token
    delta = logp - old_logp  # (B, T)
    ratio = torch.exp(delta.detach().masked_fill(mask == 0, 0))  # (B, T)  r_t
    A = advantages[:, None]  # (B, 1)
    per_token = -torch.clamp(ratio, max=ess) * logp * A  # (B, T)  P3O: -sg(clamp(r_t, 0, ESS)) logp_t A_i
    if tis_weights is not None:
        per_token = per_token * tis_weights  # (B, T)
    kl_old = delta + torch.exp(torch.clamp(-delta, -10, 10)) - 1  # (B, T)  P3O: KL to the behaviour policy
    per_token = per_token + (1 - ess) * kl_old  # (B, T)  P3O: adaptive trust region
    if args.beta > 0:
        kl = (logp - ref_logp) + torch.exp(torch.clamp(ref_logp - logp, -10, 10)) - 1  # (B, T)  P3O: kl_old's form
        per_token = per_token + args.beta * kl  # (B, T)
    if args.entropy_coeff > 0:
        per_token = per_token - args.entropy_coeff * entropy  # (B, T)  P3O: entropy bonus
    loss = (per_token * mask).sum() / num_tokens.to(logp.dtype)  # P3O: token mean over the optimizer batch

    with torch.no_grad():
        token_mean = lambda x: (x * mask).sum() / mask.sum().clamp(min=1)  # noqa: E731
        metrics = {
            "loss/policy": loss.detach(),
            "policy/ratio_mean": token_mean(ratio),
            "p3o/ess": ess,
            "p3o/behaviour_kl": token_mean(kl_old),
            "p3o/capped_frac": token_mean((ratio > ess).float()),
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
                        logp, entropy = completion_logprobs(model, input_ids, attention, T, args.temperature,  # P3O:
                                                            args.entropy_coeff > 0)  # P3O: the bonus's gradient
                        if run.on_policy:  # these weights sampled the batch: old_logp is logp, without gradient
                            old_logp[micro] = logp.detach()
                        loss, loss_metrics = compute_loss(
                            logp, old_logp[micro], take(ref_logp, micro), advantages[micro], mask[micro], args,
                            tis_weights=take(tis_weights, micro), entropy=entropy,  # P3O:
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
