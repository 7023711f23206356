"""Names a user brings from elsewhere: TRL's `GRPOConfig` fields (and its scripts'
`--model_name_or_path`, `--dataset_name`), and habits such as `--lr`, answered with this project's
flag. Imported only when a flag or a --config field is unknown (common/args.py)."""

import difflib
import re

ADAMW = "none: AdamW (torch's, fused), with its default betas and eps"
SAMPLING = "none: sampling is --temperature and --top_p"

# A name this project does not have -> what to pass instead. Names that mean the same here and in
# TRL (--learning_rate, --beta, --num_generations, ...) are flags already and are not listed.
ELSEWHERE = {
    "lr": "--learning_rate",
    "per_device_train_batch_size": (
        "--micro_batch_size (completions per forward on each process); --batch_size counts a "
        "step's completions over all processes (TRL's per_device_train_batch_size x processes x "
        "gradient_accumulation_steps)"
    ),
    "gradient_accumulation_steps": (
        "none: it follows from --mini_batch_size / (processes x --micro_batch_size)"
    ),
    "generation_batch_size": "--batch_size (completions sampled per step, over all processes)",
    "steps_per_generation": (
        "--mini_batch_size (completions per optimizer step; --batch_size / --mini_batch_size "
        "optimizer steps per batch)"
    ),
    "max_steps": "--total_steps (RL steps, one batch of rollouts each)",
    "num_train_epochs": "--total_steps (RL steps; there are no epochs)",
    "bf16": "--dtype bfloat16",
    "fp16": "--dtype float16",
    "torch_dtype": "--dtype",
    "model_name_or_path": "--model",
    "dataset_name": "--dataset",
    "dataset_train_split": "--split",
    "dataset_test_split": "--eval_split",
    "resume_from_checkpoint": "--resume_from (a checkpoint folder, or a run folder: its latest)",
    "use_vllm": "--rollout_engine vllm",
    "vllm_mode": "colocate is --rollout_engine vllm; server is --server_url http://HOST:PORT",
    "vllm_server_base_url": "--server_url",
    "vllm_server_host": "--server_url http://HOST:PORT",
    "vllm_server_port": "--server_url http://HOST:PORT",
    "vllm_server_timeout": "--server_timeout",
    "mask_truncated_completions": "--mask_truncated",
    "vllm_importance_sampling_correction": "--tis_cap C (0, the default here: off)",
    "vllm_importance_sampling_mode": "--tis_mode token|sequence, with --mis for the *_mask modes",
    "vllm_importance_sampling_clip_max": "--tis_cap",
    "vllm_importance_sampling_cap": "--tis_cap",
    "vllm_importance_sampling_clip_min": "--tis_floor (with --mis)",
    "loss_type": (
        "each loss is a script of its own (gspo.py, cispo.py, sapo.py, luspo.py, vespo.py, ...); "
        "grpo.py is TRL's grpo, landscape.py --loss_agg token-mean its dapo and token-sum-norm its "
        "dr_grpo"
    ),
    "importance_sampling_level": "sequence is gspo.py",
    "scale_rewards": (
        "none: grpo.py divides by each group's standard deviation (TRL's 'group'); other "
        "advantages are other scripts (rloo.py, reinforcepp.py, ...)"
    ),
    "top_k": SAMPLING,
    "min_p": SAMPLING,
    "repetition_penalty": SAMPLING,
    "eval_strategy": "--eval_steps (0: off)",
    "save_strategy": "--save_steps (0: only at the end)",
    "logging_steps": "none: every step is logged (metrics.jsonl and --report_to)",
    "warmup_ratio": "--warmup_steps (optimizer steps)",
    "optim": ADAMW,
    "adam_beta1": ADAMW,
    "adam_beta2": ADAMW,
    "adam_epsilon": ADAMW,
    "use_peft": "--lora_r R (0: all weights train)",
    "chat_template_kwargs": "--enable_thinking (Qwen3's), --system_prompt or --use_chat_template",
    "max_tool_calling_iterations": "--max_turns (model turns per completion)",
    "deepspeed": "accelerate launch --config_file configs/accelerate/zero3.yaml (or zero2.yaml)",
    "fsdp": "accelerate launch --config_file configs/accelerate/fsdp2.yaml",
    "push_to_hub": "none: upload a checkpoint's model/ folder (hf upload)",
}
SDPO_ONE_MODE = "none: sdpo.py distills TRL's sampled_token mode only (docs/estimators/sdpo.md)"
# TRL's SDPOConfig fields that sdpo.py names otherwise or does not have
SDPO_NAMES = {
    "teacher_model_kind": "sdpo.py --teacher (ema, base or live)",
    "success_reward_threshold": "sdpo.py --success_threshold",
    "teacher_sync_steps": "sdpo.py --teacher_update_rate (the EMA moves at every optimizer step)",
    "distillation_mode": SDPO_ONE_MODE,
    "distillation_topk": SDPO_ONE_MODE,
    "distillation_alpha": SDPO_ONE_MODE,
    "distillation_add_tail": SDPO_ONE_MODE,
    "use_successful_as_teacher": "none: sdpo.py always re-prompts with a successful sibling",
    "max_reprompt_len": "none: sdpo.py does not cut the re-prompted context",
    "include_environment_feedback": "sdpo.py --feedback_column privileged_context (TRL's column)",
    "remove_thinking_from_demonstration": "none: sdpo.py keeps <think> in a demonstration",
    "use_teacher_server": "none: sdpo.py's teacher runs in the trainer's processes",
    "diagnostics_warning_interval": "none: sdpo.py logs sdpo/* metrics every step",
    "diagnostics_flat_tolerance": "none: sdpo.py logs sdpo/* metrics every step",
}
ELSEWHERE.update(SDPO_NAMES)
# TRL's scripts' own arguments (ScriptArguments, ModelConfig) and habits: not GRPOConfig fields
NOT_GRPOCONFIG = {
    "lr",
    "model_name_or_path",
    "dataset_name",
    "dataset_train_split",
    "dataset_test_split",
    "use_peft",
    "torch_dtype",
    "warmup_ratio",
}


def hint(name: str, fields: list[str], prefix: str = "--") -> str | None:
    """What to pass instead of `name` (a flag as typed, or a --config field): this project's flag
    for a name from TRL or a habit, else the closest field's name, else None."""
    bare = name.split("=")[0].removeprefix(prefix).replace("-", "_")
    instead = ELSEWHERE.get(bare, "")
    if re.fullmatch(r"--\w+", instead):  # the same setting by another name
        return f"did you mean {instead}?"
    if instead.startswith("none: "):
        return f"no such setting here; {instead.removeprefix('none: ')}"
    if instead:
        return f"here {instead}"
    close = difflib.get_close_matches(bare, fields, 1)
    return f"did you mean {prefix}{close[0]}?" if close else None
