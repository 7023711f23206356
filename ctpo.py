"""CTPO: Cumulative Token Policy Optimization (Zhang et al. 2026, arXiv:2605.07331; seed 002 sections 3.1, 3.3).

    rho_t = exp(min(c_t, 10)),  c_t = sum_{k<=t} mask_k clamp(logp_k - old_logp_k, -20, 20)  (gradient via logp_t only)
    L = mean_{valid i,t} [max(-A_i rho_t, -A_i exp(clamp(log rho_t, -clip_low b_t, clip_high b_t))) + beta kl_t],
        b_t = p_t ** clip_power (p_t: 1-based position), and the term is capped at -A_i exp(clip_c b_t) when A_i < 0

Differs from grpo.py (formulas lost in the paper's extraction, from the authors' loss "cum-token-cumprod-la"):
- the ratio of token t is the prefix ratio pi(y_<=t) / pi_old(y_<=t), with a stop-gradient on the prefix;
- log-space clip bounds grow like p_t ** clip_power (0: fixed, see ctpo_qwen3_14b_fixed_clip.yaml); dual clip for A < 0;
- a token mean over the optimizer batch; beta 0 by default; no seed 003 switches.

Run:
    python ctpo.py --preset toy                                  # CPU, minutes
    accelerate launch ctpo.py --model Qwen/Qwen3-4B --dataset gsm8k
"""

import contextlib
import math
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import broadcast_object_list, gather_object, set_seed
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

from common.batching import RolloutQueue, Rollouts, fill_batch, importance_weights, overlong_penalty
from common.checks import check_args, claim_run_dir, record_args, stop_if_nonfinite
from common.data import load_prompts, resolve_dataset
from common.rewards import compute_rewards, get_reward_function
from common.multiturn import sample_completions, tool_metrics
from common.rollout import HFEngine, sample_seed
from common.toy import prepare_preset
from common.utils import (MetricsLog, TrainState, batch_metrics, check_weight_sync, completion_logprobs,
                          find_checkpoint, length_buckets, logp_gap, mean_grad_norm, mean_over_processes, on_cpu, pad_rows,
                          parse_args, peak_memory_gib, prepare_policy, prepare_reference, save_checkpoint,
                          sharded_parameters, step_prompts, timed)
from common.vllm_engine import VLLMEngine, vllm_available
from evals.run import evaluate_training, load_eval_sets


@dataclass
class Args:
    # Experiment
    exp_name: str = field(default=os.path.basename(__file__)[: -len(".py")], metadata={"help": "name of this experiment"})
    seed: int = field(default=1, metadata={"help": "seed of the run (weights init of LoRA, data order, sampling)"})
    preset: str | None = field(default=None, metadata={"help": "a named set of defaults: toy (CPU, minutes)"})
    output_dir: str = field(default="runs", metadata={"help": "runs are written to output_dir/run_name"})
    run_name: str | None = field(default=None, metadata={"help": "default: {exp_name}__{seed}__{unix time}"})
    report_to: str = field(default="tensorboard", metadata={"help": "tracker: tensorboard, wandb, trackio, mlflow or none"})
    save_steps: int = field(default=100, metadata={"help": "checkpoint every this many steps (0: only at the end)"})
    save_total_limit: int = field(default=0, metadata={"help": "keep only the last N checkpoints (0: all)"})
    resume_from: str | None = field(default=None, metadata={"help": "a checkpoint folder, or a run folder (its latest)"})
    resume_overrides: str = field(default="", metadata={"help": "comma-separated settings a resume may change (others must match the run's)"})
    # Model
    model: str = field(default="Qwen/Qwen3-4B", metadata={"help": "hub id or local folder of the policy"})
    dtype: Literal["bfloat16", "float16", "float32"] = field(default="bfloat16", metadata={"help": "weights dtype: bfloat16, float16 or float32"})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "trade compute for activation memory"})
    lora_r: int = field(default=0, metadata={"help": "LoRA rank; 0 trains all weights"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha"})
    lora_target_modules: str = field(default="all-linear", metadata={"help": "comma-separated module names, or all-linear"})
    # Data and rewards
    dataset: str = field(default="gsm8k", metadata={"help": "preset (gsm8k, math, numina, deepscaler), hub id or local file/folder"})
    dataset_config: str | None = field(default=None, metadata={"help": "dataset configuration name (hub datasets)"})
    split: str | None = field(default=None, metadata={"help": "training split (default: the preset's, else train)"})
    eval_dataset: str | None = field(default=None, metadata={"help": "held-out prompts (default: --dataset)"})
    eval_split: str | None = field(default=None, metadata={"help": "held-out split (default: the preset's, else test)"})
    prompt_column: str | None = field(default=None, metadata={"help": "column with the question (default: the preset's, else prompt)"})
    answer_column: str | None = field(default=None, metadata={"help": "column with the reference answer (default: the preset's, else answer)"})
    prompt_template: str = field(
        default="{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}.",
        metadata={"help": "user message; {prompt} is replaced by the question"})
    system_prompt: str = field(default="", metadata={"help": "system message (chat templates only)"})
    use_chat_template: bool = field(default=True, metadata={"help": "wrap prompts in the tokenizer's chat template"})
    enable_thinking: bool = field(default=False, metadata={"help": "Qwen3's thinking mode in the chat template"})
    reward_funcs: str = field(default="math_accuracy", metadata={"help": "comma-separated registered names or module:function"})
    reward_weights: str | None = field(default=None, metadata={"help": "comma-separated weights (default: all 1)"})
    # Rollouts
    rollout_engine: Literal["auto", "vllm", "hf"] = field(default="auto", metadata={"help": "vllm, hf (transformers generate), or auto (vllm if usable)"})
    max_prompt_length: int = field(default=512, metadata={"help": "longer prompts are dropped from the data"})
    max_completion_length: int = field(default=1024, metadata={"help": "tokens generated per completion at most"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (the policy is softmax(logits / T))"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling"})
    vllm_gpu_memory_utilization: float = field(default=0.3, metadata={"help": "GPU memory fraction vLLM may take"})
    vllm_tensor_parallel_size: int = field(default=1, metadata={"help": "GPUs per vLLM engine (consecutive ranks)"})
    tis_cap: float = field(default=0.0, metadata={"help": "importance sampling cap for sampler/trainer mismatch; 0: off"})
    tis_mode: Literal["token", "sequence"] = field(default="token", metadata={"help": "--tis_cap on each token's ratio, or on each completion's (the product)"})
    mis: bool = field(default=False, metadata={"help": "masked IS: a ratio above --tis_cap gets weight 0, not the cap (token or completion)"})
    old_logp_source: Literal["trainer", "sampler"] = field(default="trainer", metadata={"help": "old_logp: the trainer's no-grad pass at the sampling weights, or the sampler's log-probs as returned (FeynRL)"})
    max_logp_gap: float = field(default=0.5, metadata={"help": "stop when rollout/logp_gap_mean exceeds this: the sampler is not running the trainer's weights (0: off)"})
    max_turns: int = field(default=1, metadata={"help": "model turns per completion; > 1: tool-integrated (TIR): each closed code block runs in a sandbox, its output joins the context, not the loss"})
    tool: str = field(default="simpletir", metadata={"help": "with --max_turns > 1: simpletir (Python in ``` blocks, SimpleTIR's format) or toy (the toy_tir calculator)"})
    rollout_lag: int = field(default=0, metadata={"help": "K: the batch trained at step s was sampled with the weights of step s-K (verl, prime-rl async)"})
    dynamic_sampling: bool = field(default=False, metadata={"help": "DAPO: drop groups whose rewards are all equal, sample more prompts to fill the batch"})
    max_refill_rounds: int = field(default=4, metadata={"help": "dynamic sampling: extra rounds at most; slots still empty leave the loss"})
    mask_truncated: bool = field(default=False, metadata={"help": "completions cut at max_completion_length leave the loss (DAPO)"})
    overlong_buffer: int = field(default=0, metadata={"help": "DAPO soft overlong penalty: a reward term over the last N tokens before the limit (0: off)"})
    overlong_penalty: float = field(default=1.0, metadata={"help": "the overlong reward term at max_completion_length: -overlong_penalty"})
    # Optimisation
    total_steps: int = field(default=500, metadata={"help": "RL steps (one batch of rollouts each)"})
    batch_size: int = field(default=256, metadata={"help": "completions per step over all processes: B = prompts x G"})
    num_generations: int = field(default=8, metadata={"help": "completions per prompt, G"})
    mini_batch_size: int = field(default=0, metadata={"help": "completions per optimizer step over all processes; 0: batch_size"})
    micro_batch_size: int = field(default=4, metadata={"help": "completions per forward/backward on each process"})
    logprob_batch_size: int = field(default=0, metadata={"help": "completions per no-grad forward (old / reference log-probs) on each process; 0: micro_batch_size"})
    num_iterations: int = field(default=1, metadata={"help": "passes over each batch of rollouts (mu)"})
    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW learning rate"})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "transformers scheduler name"})
    warmup_steps: int = field(default=0, metadata={"help": "learning-rate warmup in optimizer steps"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    max_grad_norm: float = field(default=1.0, metadata={"help": "gradient clipping"})
    eval_steps: int = field(default=50, metadata={"help": "held-out greedy accuracy every this many steps (0: off)"})
    eval_num_prompts: int = field(default=500, metadata={"help": "held-out prompts per evaluation"})
    eval_benchmarks: str = field(default="", metadata={"help": "evals/ benchmarks (e.g. math500,aime25; NAME=FILE for a local copy) logged as eval/<name>/avg@k"})
    eval_num_samples: int = field(default=1, metadata={"help": "samples per benchmark question, k of avg@k (1: greedy)"})
    dump_stats_steps: int = field(default=0, metadata={"help": "save batch_stats' per-row tensors to run_dir/stats every this many steps (0: off)"})
    # Algorithm-specific
    beta: float = field(default=0.0, metadata={"help": "KL coefficient to the reference policy (k3, per token)"})
    clip_low: float = field(default=0.025, metadata={"help": "log-space lower clip bound at position 1: log rho_t >= -clip_low * p_t ** clip_power"})
    clip_high: float = field(default=0.05, metadata={"help": "log-space upper clip bound at position 1: log rho_t <= clip_high * p_t ** clip_power"})
    clip_c: float = field(default=0.05, metadata={"help": "log-space dual clip for A < 0: a token's loss is at most -A * exp(clip_c * p_t ** clip_power)"})
    clip_power: float = field(default=0.5, metadata={"help": "the bounds grow like p_t ** clip_power; 0: fixed bounds (Table 3's ablation; its bounds are not published)"})


# ALGO LOGIC: advantages and loss
def compute_advantages(rewards: torch.Tensor, args: Args) -> torch.Tensor:
    """Group-normalised advantages; rows of one prompt are contiguous."""
    grouped = rewards.view(-1, args.num_generations)  # (N, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (N, G)
    return (centered / (grouped.std(dim=1, keepdim=True) + 1e-6)).flatten()  # (B,)


def batch_stats(current_logp, old_logp, advantages, mask, args: Args) -> dict[str, torch.Tensor]:
    """What compute_loss needs from the whole optimizer batch when it is called per micro-batch.

    Scalars are sums over this process's rows (the loop adds them up over processes); (rows,) tensors
    are per-row values. `current_logp()` gives (rows, T) log-probs at the current weights, without
    gradient, for estimators whose statistics depend on them (on-policy it is old_logp: no extra pass).
    """
    return {"num_tokens": mask.sum().float()}  # CTPO: a token mean over the optimizer batch


# CTPO Figure 1 by position p_t: std of c_t, clip rate, and the rate a fixed ratio window has on the same rho_t
POSITION_BUCKETS = {"pos_1-16": (1, 16), "pos_17-64": (17, 64), "pos_65-256": (65, 256),
                    "pos_257-1024": (257, 1024), "pos_1025+": (1025, math.inf)}
FIG1_FIXED_WINDOW = (0.5, 5.0)  # "Fixed clip: ratio in [0.5, 5]" (horizon-llm/CTPO scripts/plot_clip_rate_vs_position.py)


def masked_std(x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Population std of x over the entries where `where` is true (0 if there are none)."""
    n = where.sum().clamp(min=1)
    return (((x - (x * where).sum() / n) ** 2) * where).sum().div(n).sqrt()


def compute_loss(logp, old_logp, ref_logp, advantages, mask, args: Args, num_tokens=None, tis_weights=None):
    """CTPO loss with full-batch semantics (seed 002 section 3; arXiv:2605.07331). `num_tokens` (default: this
    batch's valid tokens) is the denominator over the whole optimizer batch when called per micro-batch;
    `tis_weights` (B, T) multiply the policy term per token (TIS / MIS: common.batching). c_t and p_t run over
    mask = 1 tokens only: tool output (mask 0) is context, not an action, and neither counts nor adds a ratio."""
    mask = mask.float()  # (B, T)
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    delta = torch.clamp(logp - old_logp, -20, 20)  # (B, T)  CTPO: d_t
    cum_logratio = torch.cumsum(mask * delta, dim=-1).detach()  # (B, T)  CTPO: sg(c_t), c_t = sum_{k<=t} mask_k d_k
    log_ratio = torch.clamp(cum_logratio + logp - logp.detach(), max=10)  # (B, T)  CTPO: log rho_t, grad via logp_t
    ratio = torch.exp(log_ratio)  # (B, T)  CTPO: rho_t
    A = advantages[:, None]  # (B, 1)
    position = torch.cumsum(mask, dim=-1)  # (B, T)  CTPO: p_t, 1-based on valid tokens
    scale = position.clamp(min=1) ** args.clip_power  # (B, T)  CTPO: b_t = p_t ** clip_power
    clipped = torch.exp(torch.clamp(log_ratio, -args.clip_low * scale, args.clip_high * scale))  # (B, T)  CTPO
    surrogate = torch.min(ratio * A, clipped * A)  # (B, T)  -l_t = -max(l1, l2)
    dual = A * torch.exp(args.clip_c * scale)  # (B, T)  CTPO: dual clip, l_t <= -A exp(clip_c b_t) for A < 0
    is_dual = (A < 0) & (surrogate < dual)  # (B, T)
    surrogate = torch.where(is_dual, dual, surrogate)  # (B, T)  CTPO: gradient zeroed where capped
    if tis_weights is not None:
        surrogate = surrogate * tis_weights  # (B, T)
    per_token = surrogate  # (B, T)
    if args.beta > 0:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # (B, T)  k3
        per_token = per_token - args.beta * kl  # (B, T)
    loss = -(per_token * mask).sum() / max(num_tokens, 1)  # CTPO: token mean over the optimizer batch

    with torch.no_grad():
        token_mean = lambda x: (x * mask).sum() / mask.sum().clamp(min=1)  # noqa: E731
        is_low = (log_ratio < -args.clip_low * scale) & (A < 0)  # (B, T) clipped from below (gradient zeroed)
        is_high = (log_ratio > args.clip_high * scale) & (A > 0)  # (B, T)
        lo_fixed, hi_fixed = math.log(FIG1_FIXED_WINDOW[0]), math.log(FIG1_FIXED_WINDOW[1])
        is_fixed = ((log_ratio < lo_fixed) & (A < 0)) | ((log_ratio > hi_fixed) & (A > 0))  # (B, T)  Figure 1
        metrics = {
            "loss/policy": loss.detach(),
            "policy/ratio_mean": token_mean(ratio),
            "policy/clip_frac_low": token_mean(is_low.float()),
            "policy/clip_frac_high": token_mean(is_high.float()),
            "policy/clip_frac": token_mean((is_low | is_high).float()),
            "policy/dual_clip_frac": token_mean(is_dual.float()),
            "policy/cum_logratio_std": masked_std(cum_logratio, mask > 0),
        }
        # buckets the padded width T reaches (in the loop: the longest completion of this process), so that
        # every micro-batch logs the same keys; one with no token in a bucket logs 0 for it
        for name, (lo, hi) in POSITION_BUCKETS.items():
            if lo <= mask.shape[1]:
                in_bucket = (mask > 0) & (position >= lo) & (position <= hi)  # (B, T)
                metrics[f"ctpo/cum_logratio_std/{name}"] = masked_std(cum_logratio, in_bucket)
                for key, clipped_here in (("clip_frac", is_low | is_high), ("fixed_clip_frac", is_fixed)):
                    metrics[f"ctpo/{key}/{name}"] = (clipped_here & in_bucket).sum() / in_bucket.sum().clamp(min=1)
        if args.beta > 0:
            metrics["policy/kl"] = token_mean(kl)
    return loss, metrics


def main(args: Args):
    state = PartialState(cpu=on_cpu())  # on a CPU-only machine accelerate forms a gloo group only when told
    with state.main_process_first():
        prepare_preset(args.preset)  # the toy's model and data, built once
    check_args(args, state.num_processes)
    resume = find_checkpoint(args.resume_from) if args.resume_from else None
    run_name = [args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"]
    broadcast_object_list(run_name)  # every process writes to the same run folder
    run_dir = claim_run_dir(args, resume, run_name[0])  # a new folder or the resumed run's, locked while this runs
    M = args.mini_batch_size or args.batch_size
    local_rows, local_mini = args.batch_size // state.num_processes, M // state.num_processes
    accelerator = Accelerator(
        gradient_accumulation_steps=local_mini // args.micro_batch_size,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=run_dir,  # tensorboard writes its event files here
        step_scheduler_with_optimizer=False,  # the scheduler steps once per optimizer step, whatever the process count
    )
    set_seed(args.seed)

    # Model, reference, data
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    ref_model = None
    if args.lora_r > 0:  # the reference is the base model: the adapter disabled, no second copy
        from peft import LoraConfig, get_peft_model

        targets = args.lora_target_modules if args.lora_target_modules == "all-linear" else args.lora_target_modules.split(",")
        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules=targets,
                                                 task_type="CAUSAL_LM"))
    elif args.beta > 0:
        ref_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval().requires_grad_(False)
    data = resolve_dataset(args.dataset, args.split, args.prompt_column, args.answer_column, args.eval_split)
    prompt_kwargs = dict(prompt_column=data["prompt_column"], answer_column=data["answer_column"],
                         template=args.prompt_template, system_prompt=args.system_prompt,
                         use_chat_template=args.use_chat_template, enable_thinking=args.enable_thinking,
                         max_prompt_length=args.max_prompt_length)
    with accelerator.main_process_first():  # the main process fills the datasets cache first
        train_data = load_prompts(tokenizer, data["path"], args.dataset_config or data["name"], data["split"], **prompt_kwargs)
        eval_data = None
        eval_sets = load_eval_sets(args.eval_benchmarks, tokenizer, use_chat_template=args.use_chat_template,
                                   enable_thinking=args.enable_thinking, system_prompt=args.system_prompt,
                                   max_prompt_length=args.max_prompt_length) if args.eval_steps > 0 else []
        if args.eval_steps > 0 and (args.eval_dataset or data["eval_split"]):
            eval_spec = resolve_dataset(args.eval_dataset or args.dataset, args.eval_split, args.prompt_column,
                                        args.answer_column) if args.eval_dataset else data
            eval_data = load_prompts(tokenizer, eval_spec["path"], args.dataset_config or eval_spec["name"],
                                     eval_spec["eval_split"] if not args.eval_dataset else eval_spec["split"], **prompt_kwargs)
            eval_data = eval_data.select(range(min(args.eval_num_prompts, len(eval_data))))
    reward_funcs = [get_reward_function(name) for name in args.reward_funcs.split(",")]
    reward_weights = [float(w) for w in args.reward_weights.split(",")] if args.reward_weights else None
    reward_columns = [c for c in train_data.column_names if c not in ("prompt", "prompt_text", "prompt_ids")]

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.learning_rate,
                                  weight_decay=args.weight_decay, fused=True)  # one kernel per step (TRL's default)
    optimizer_steps = args.total_steps * args.num_iterations * (args.batch_size // M)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, args.warmup_steps, optimizer_steps)
    model, optimizer, scheduler = prepare_policy(accelerator, args.micro_batch_size, model, optimizer, scheduler)
    if ref_model is not None:
        ref_model = prepare_reference(accelerator, ref_model)
    train_state = TrainState()
    accelerator.register_for_checkpointing(train_state)
    queue = RolloutQueue(args.rollout_lag)  # --rollout_lag: the batches sampled ahead (each process its own rows)
    if resume:
        accelerator.load_state(os.path.join(resume, "state"))
        queue.load(os.path.join(resume, "state"), accelerator.process_index)

    use_vllm = args.rollout_engine == "vllm" or (args.rollout_engine == "auto" and vllm_available())
    if use_vllm:
        engine = VLLMEngine(args.model, accelerator=accelerator, tensor_parallel_size=args.vllm_tensor_parallel_size,
                            gpu_memory_utilization=args.vllm_gpu_memory_utilization, seed=args.seed,
                            max_model_len=args.max_prompt_length + args.max_completion_length, dtype=args.dtype)
        engine.push_weights(model)  # a resumed or LoRA-wrapped policy differs from the files on disk
    else:
        engine = HFEngine(tokenizer, accelerator)

    if accelerator.is_main_process:
        accelerator.init_trackers(run_name[0], config={k: v for k, v in asdict(args).items() if v is not None})
        record_args(run_dir, asdict(args), train_state.step)
    log = MetricsLog(run_dir, accelerator.is_main_process, resume_step=train_state.step)

    def evaluate() -> dict:
        """The --eval_benchmarks and, on held-out prompts, greedy accuracy (the first reward function)."""
        return evaluate_training(engine, model, tokenizer, args, accelerator, eval_sets, eval_data, reward_funcs[0],
                                 reward_columns)

    evaluating = args.eval_steps > 0 and (eval_data is not None or len(eval_sets) > 0)
    if evaluating and train_state.step == 0:
        log.write({"step": 0, **evaluate()})
    G = args.num_generations
    # On-policy (one optimizer step per batch, no lag, no TIS, the trainer's old_logp), old_logp is the update's own
    # logp.detach(): no pass. --old_logp_source sampler takes the sampler's log-probs as they are: no pass either.
    on_policy = (args.num_iterations == 1 and M == args.batch_size and args.rollout_lag == 0 and args.tis_cap == 0
                 and args.old_logp_source == "trainer")

    def logprobs_of(net, batch: dict, rows: slice = slice(0, local_rows)) -> torch.Tensor:
        """No gradient: --logprob_batch_size rows per forward; the rows of a prompt share one forward of it."""
        share, size = not sharded_parameters(accelerator), args.logprob_batch_size or args.micro_batch_size
        with torch.no_grad():
            buckets = length_buckets(batch["completion_tokens"][rows], size, offset=rows.start)  # similar lengths
            logp = torch.cat([completion_logprobs(net, batch["input_ids"][s], batch["attention_mask"][s],
                                                  batch["mask"].shape[1], args.temperature, share_prompts=share)[0]
                              for s in buckets])  # (rows, T) by bucket
            return logp[torch.cat(buckets).argsort()]  # (rows, T) in row order

    def sample_batch(index: int, metrics: dict) -> dict:
        """Steps 1-4 for the batch trained at step `index`, sampled now, with the current weights (--rollout_lag K:
        K steps ahead). Its behaviour and reference log-probs are taken now too, at the weights that sampled it."""

        # 1. Rollouts and rewards: G completions for each of this process's prompts (whole groups per process, so
        # rewards need no communication); round r > 0 samples more prompts for --dynamic_sampling
        def sample_round(r: int) -> Rollouts:
            positions, indices = step_prompts(index, args.batch_size, G, args.mini_batch_size, accelerator.num_processes,
                                              accelerator.process_index, len(train_data), args.seed + 1_000_003 * r)
            rows = train_data[indices]  # {column: values}
            prompt_ids = [p for p in rows["prompt_ids"] for _ in range(G)]
            seeds = [sample_seed(args.seed, index, position + r * args.batch_size, j) for position in positions for j in range(G)]
            engine.wake_up()
            with timed(metrics, "time/rollout"):  # --max_turns > 1: tool output is part of a completion, not its actions
                out = sample_completions(engine, model, tokenizer, prompt_ids, seeds, max_tokens=args.max_completion_length,
                                         temperature=args.temperature, top_p=args.top_p, max_turns=args.max_turns, tool=args.tool)
            engine.sleep()
            completion_ids = out.completion_ids
            metrics.update(tool_metrics(out) if args.max_turns > 1 else {})  # turns, calls, errors, tool time
            completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
            columns = {c: [v for v in rows[c] for _ in range(G)] for c in reward_columns}
            rewards, per_func = compute_rewards(reward_funcs, reward_weights, [p for p in rows["prompt"] for _ in range(G)],
                                                completions, columns)  # (B,)
            if args.overlong_buffer > 0:  # DAPO: a reward term, falling to -overlong_penalty at the length limit
                per_func["overlong"] = overlong_penalty(torch.tensor([len(c) for c in completion_ids]),
                                                        args.max_completion_length, args.overlong_buffer, args.overlong_penalty)
                rewards = rewards + per_func["overlong"]  # (B,)
            truncated = torch.tensor([finish == "length" for finish in out.finish])  # (B,)
            return Rollouts(prompt_ids, completion_ids, out.sampler_logp, rewards, per_func, truncated, out.action_mask)

        rollouts, removed = (fill_batch(sample_round, local_rows // G, G, accelerator, args.max_refill_rounds, metrics)
                             if args.dynamic_sampling else (sample_round(0), torch.zeros(local_rows, dtype=torch.bool)))

        # 2. Advantages, and rows removed from the loss (--mask_truncated; slots dynamic sampling could not fill)
        advantages = compute_advantages(rollouts.rewards, args)  # (B,)
        removed |= rollouts.truncated & args.mask_truncated  # (B,)

        # 3. Tensors: [left-padded prompt | right-padded completion]; mask marks the completion tokens the loss sees
        prompts_t = pad_rows(rollouts.prompt_ids, tokenizer.pad_token_id, left=True)  # (B, P)
        completion_tokens = pad_rows([[1] * len(c) for c in rollouts.completion_ids], 0)  # (B, T) EOS included
        batch = {"input_ids": torch.cat([prompts_t, pad_rows(rollouts.completion_ids, tokenizer.pad_token_id)], dim=1),
                 "attention_mask": torch.cat([(prompts_t != tokenizer.pad_token_id).long(), completion_tokens], dim=1),
                 "completion_tokens": completion_tokens, "mask": completion_tokens * pad_rows(rollouts.action_mask, 0)
                 * ~removed[:, None],  # (B, T)  the model's own tokens, not tool output, in rows the loss keeps
                 "advantages": advantages, "sampler_logp": pad_rows(rollouts.sampler_logp, 0.0),  # (B,), (B, T)
                 "rewards": rollouts.rewards, "truncated": rollouts.truncated, "per_func": rollouts.per_func}
        batch = {k: v.to(accelerator.device) if torch.is_tensor(v) else v for k, v in batch.items()}

        # 4. Behaviour (old) and reference log-probs at the weights that sampled, without gradient
        with timed(metrics, "time/logprobs"):
            batch["old_logp"] = (torch.zeros_like(batch["sampler_logp"]) if on_policy else batch["sampler_logp"].clone()
                                 if args.old_logp_source == "sampler" else logprobs_of(model, batch))  # (B, T)
            lora_reference = args.beta > 0 and ref_model is None  # LoRA: the base model is the adapter turned off
            with accelerator.unwrap_model(model).disable_adapter() if lora_reference else contextlib.nullcontext():
                batch["ref_logp"] = logprobs_of(model if lora_reference else ref_model, batch) if args.beta > 0 else None
        return batch

    progress = tqdm(range(train_state.step, args.total_steps), initial=train_state.step, total=args.total_steps,
                    disable=not accelerator.is_local_main_process, desc=args.exp_name)
    for step in progress:
        step_start = time.time()
        metrics = {}

        # 1-4. The batch of this step, sampled --rollout_lag steps ago; the batch of step + K is sampled now
        batch = queue.next(step, lambda index: sample_batch(index, metrics), args.total_steps)
        input_ids, attention_mask, mask, advantages, old_logp, ref_logp = (
            batch[k] for k in ("input_ids", "attention_mask", "mask", "advantages", "old_logp", "ref_logp"))
        T, tis_weights = mask.shape[1], None
        if args.tis_cap > 0:  # sampler/trainer mismatch: truncated (--mis: masked) importance sampling
            tis_weights, metrics["rollout/is_masked_frac"] = importance_weights(
                old_logp, batch["sampler_logp"], mask, args.tis_cap, args.tis_mode, args.mis)  # (B, T)

        # 5. Policy updates: num_iterations passes, one optimizer step per mini-batch
        model.train()
        update_start = time.time()
        step_metrics, grad_norms, dumps = [], [], []
        dumping = args.dump_stats_steps > 0 and (step + 1) % args.dump_stats_steps == 0  # e.g. SNIB's Figure 2
        for _ in range(args.num_iterations):
            for mb_start in range(0, local_rows, local_mini):
                mb = slice(mb_start, mb_start + local_mini)
                # Statistics of the whole optimizer batch: scalars are sums over rows, added up over all
                # processes; per-row values stay with their rows (groups never straddle processes).
                current_logp = (lambda: old_logp[mb]) if on_policy else (lambda: logprobs_of(model, batch, mb))
                stats = batch_stats(current_logp, old_logp[mb], advantages[mb], mask[mb], args)
                stats = {k: accelerator.reduce(v, "sum") if v.dim() == 0 else v for k, v in stats.items()}
                if dumping:
                    dumps.append({k: v.cpu() for k, v in stats.items() if v.dim() == 1})
                for s in length_buckets(batch["completion_tokens"][mb], args.micro_batch_size, offset=mb_start):
                    rows = s - mb_start  # the micro-batch's rows within the mini-batch
                    with accelerator.accumulate(model):
                        logp, entropy = completion_logprobs(model, input_ids[s], attention_mask[s], T, args.temperature)
                        if on_policy:  # the weights that sampled the batch are these ones
                            old_logp[s] = logp.detach()
                        loss, loss_metrics = compute_loss(
                            logp, old_logp[s], None if ref_logp is None else ref_logp[s], advantages[s], mask[s], args,
                            tis_weights=None if tis_weights is None else tis_weights[s],
                            **{k: v if v.dim() == 0 else v[rows] for k, v in stats.items()})
                        # loss is this micro-batch's share of the optimizer batch's loss: undo accelerate's
                        # division by the accumulation steps and the mean over processes.
                        accelerator.backward(loss * accelerator.gradient_accumulation_steps * accelerator.num_processes)
                        if accelerator.sync_gradients:
                            grad_norms.append(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm))
                        optimizer.step()
                        optimizer.zero_grad()
                    loss_metrics["policy/entropy"] = (entropy * mask[s]).sum() / mask[s].sum().clamp(min=1)
                    step_metrics.append(loss_metrics)
                scheduler.step()
        metrics["time/update"] = time.time() - update_start
        metrics.update(logp_gap(batch["sampler_logp"], old_logp, mask))  # sampler/trainer mismatch
        check_weight_sync(metrics["rollout/logp_gap_mean"], args.max_logp_gap, step + 1)  # e.g. a push that did not land
        if any(dumps):  # only estimators with per-row statistics have something to dump
            os.makedirs(os.path.join(run_dir, "stats"), exist_ok=True)
            torch.save(dumps, os.path.join(run_dir, "stats", f"step_{step + 1:06d}.rank{accelerator.process_index}.pt"))
        with timed(metrics, "time/weight_push"):
            engine.push_weights(model)

        # 6. Logging: the update's metrics (means over micro-batches, then processes) and the trained batch's
        metrics.update(mean_over_processes(step_metrics, accelerator))
        # each micro-batch's loss is its share of the optimizer batch's: scale the mean back to a batch loss
        metrics["loss/policy"] *= accelerator.gradient_accumulation_steps * accelerator.num_processes
        metrics.update(batch_metrics(batch, G, accelerator))
        metrics.update({"step": step + 1, "optim/grad_norm": mean_grad_norm(grad_norms),
                        "optim/lr": scheduler.get_last_lr()[0], "time/step": time.time() - step_start})
        metrics["time/tokens_per_s"] = metrics["completion/tokens"] / metrics["time/step"]
        metrics["memory/peak_gib"] = max(gather_object([peak_memory_gib(accelerator.device)]))
        stop_if_nonfinite(metrics, run_dir, log)  # a broken update is neither evaluated nor saved
        train_state.step = step + 1
        if evaluating and (step + 1) % args.eval_steps == 0:
            metrics.update(evaluate())
        if (args.save_steps and (step + 1) % args.save_steps == 0) or step + 1 == args.total_steps:
            save_checkpoint(accelerator, model, tokenizer, run_dir, step + 1, args.save_total_limit, queue)
        log.write(metrics)
        accelerator.log(metrics, step=step + 1)
        progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kl=f"{metrics.get('policy/kl', 0.0):.4f}",
                             tok_s=f"{metrics['time/tokens_per_s']:.0f}")
    accelerator.end_training()
    log.print_summary()
    return run_dir

if __name__ == "__main__":
    main(parse_args(Args))
