"""Arguments: the flags every script shares (`TrainArgs`), a field with its help line (`arg`),
--preset defaults, and the parser (`parse_args`), which reads a --config recipe
(common/rails/recipes.py) under the command line.

Each script's `Args` extends `TrainArgs` with its estimator's own flags, and sets the defaults it
changes in view."""

import argparse
import copy
import dataclasses
import re
import sys
import types
from dataclasses import dataclass
from typing import Literal

from transformers import HfArgumentParser

from common.tasks.data import PRESET_NAMES, preset_defaults


def arg(default, help: str, at_least: float | None = None):
    """A field of a script's `Args` dataclass with its --help line; `at_least`: the smallest value
    the estimator accepts, checked before anything loads (common/rails/checks.py). Parse with
    `parse_args` (`ArgParser`)."""
    metadata = {"help": help} if at_least is None else {"help": help, "at_least": at_least}
    return dataclasses.field(default=default, metadata=metadata)


@dataclass
class TrainArgs:
    """The flags of the run, the model, the data and rewards, the rollouts and the optimisation: the
    same in every script, and read in common/. A script's `Args(TrainArgs)` adds its estimator's
    flags."""

    # Experiment
    exp_name: str = arg("", "name of this experiment (each script sets its file name)")
    seed: int = arg(1, "seed of the run (weights init of LoRA, data order, sampling)")
    preset: str | None = arg(
        None, "a named set of defaults: toy, toy_tir (CPU, minutes), smollm2 (a real model, CPU)",
    )
    output_dir: str = arg("runs", "runs are written to output_dir/run_name")
    run_name: str | None = arg(None, "default: {exp_name}__{seed}__{unix time}")
    report_to: str = arg("tensorboard", "tracker: tensorboard, wandb, trackio, mlflow or none")
    save_steps: int = arg(100, "checkpoint every this many steps (0: only at the end)")
    save_total_limit: int = arg(0, "keep only the last N checkpoints (0: all)")
    resume_from: str | None = arg(None, "a checkpoint folder, or a run folder (its latest)")
    resume_overrides: str = arg(
        "", "comma-separated settings a resume may change (others must match the run's)",
    )
    # Model
    model: str = arg("Qwen/Qwen3-4B", "hub id or local folder of the policy")
    dtype: Literal["bfloat16", "float16", "float32"] = arg(
        "bfloat16", "weights dtype: bfloat16, float16 or float32",
    )
    gradient_checkpointing: bool = arg(False, "trade compute for activation memory")
    gradient_checkpointing_every: int = arg(
        1,
        "with --gradient_checkpointing: recompute one decoder layer in K (1: all; 2: half of them)",
    )
    lora_r: int = arg(0, "LoRA rank; 0 trains all weights")
    lora_alpha: int = arg(32, "LoRA alpha")
    lora_target_modules: str = arg("all-linear", "comma-separated module names, or all-linear")
    # Data and rewards
    dataset: str = arg(
        "gsm8k", "preset (gsm8k, math, numina, deepscaler), hub id or local file/folder",
    )
    dataset_config: str | None = arg(None, "dataset configuration name (hub datasets)")
    split: str | None = arg(None, "training split (default: the preset's, else train)")
    eval_dataset: str | None = arg(None, "held-out prompts (default: --dataset)")
    eval_split: str | None = arg(None, "held-out split (default: the preset's, else test)")
    prompt_column: str | None = arg(
        None, "column with the question (default: the preset's, else prompt)",
    )
    answer_column: str | None = arg(
        None, "column with the reference answer (default: the preset's, else answer)",
    )
    prompt_template: str = arg(
        "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}.",
        "user message; {prompt} is replaced by the question",
    )
    system_prompt: str = arg("", "system message (chat templates only)")
    use_chat_template: bool = arg(True, "wrap prompts in the tokenizer's chat template")
    enable_thinking: bool = arg(False, "Qwen3's thinking mode in the chat template")
    reward_funcs: str = arg("math_accuracy", "comma-separated registered names or module:function")
    reward_weights: str | None = arg(None, "comma-separated weights (default: all 1)")
    reward_timeout: float = arg(
        600.0, "seconds one reward function may take on a batch, or the run stops", at_least=1,
    )
    # Rollouts
    rollout_engine: Literal["auto", "vllm", "hf"] = arg(
        "auto", "vllm, hf (transformers' generate) or auto",
    )
    max_prompt_length: int = arg(512, "longer prompts are dropped from the data")
    max_completion_length: int = arg(1024, "tokens generated per completion at most")
    temperature: float = arg(1.0, "sampling temperature (the policy is softmax(logits / T))")
    top_p: float = arg(1.0, "nucleus sampling")
    vllm_gpu_memory_utilization: float = arg(0.3, "GPU memory fraction vLLM may take")
    vllm_tensor_parallel_size: int = arg(1, "GPUs per vLLM engine (consecutive ranks)")
    server_url: str | None = arg(
        None, "rollouts from a server (python -m common.engines.serve) at http://HOST:PORT",
    )
    server_timeout: float = arg(
        600.0, "seconds a request to the server may wait for its answer", at_least=1,
    )
    tis_cap: float = arg(0.0, "importance sampling cap for sampler/trainer mismatch; 0: off")
    tis_mode: Literal["token", "sequence"] = arg(
        "token", "--tis_cap on each token's ratio or each completion's",
    )
    mis: bool = arg(
        False,
        "masked IS: a ratio above --tis_cap gets weight 0, not the cap (token or completion)",
    )
    tis_floor: float = arg(
        0.0, "with --mis, a ratio below this gets weight 0 too (IcePop: --mis --tis_cap 5 "
        "--tis_floor 0.5); 0: off",
    )
    old_logp_source: Literal["trainer", "sampler"] = arg(
        "trainer", "old_logp from a trainer pass, or the sampler's",
    )
    max_logp_gap: float = arg(
        0.5, "stop when rollout/logp_gap_mean exceeds this (a failed weight push); 0: off",
    )
    max_turns: int = arg(
        1, "model turns per completion; > 1: tool calls run in a sandbox between turns",
    )
    tool: str = arg(
        "simpletir", "with --max_turns > 1: simpletir (Python code blocks) or toy (a calculator)",
    )
    rollout_lag: int = arg(
        0, "K: the batch trained at step s was sampled by the weights of step s - K",
    )
    dynamic_sampling: bool = arg(
        False, "DAPO: replace groups of equal rewards by groups of new prompts",
    )
    max_refill_rounds: int = arg(
        4, "dynamic sampling: extra rounds at most; slots still empty leave the loss",
    )
    mask_truncated: bool = arg(
        False, "completions cut at max_completion_length leave the loss (DAPO)",
    )
    overlong_buffer: int = arg(
        0, "DAPO's soft overlong penalty over the last N tokens before the limit; 0: off",
    )
    overlong_penalty: float = arg(
        1.0, "the overlong reward term at max_completion_length: -overlong_penalty",
    )
    # Optimisation
    total_steps: int = arg(500, "RL steps (one batch of rollouts each)")
    batch_size: int = arg(256, "completions per step over all processes: B = prompts x G")
    num_generations: int = arg(8, "completions per prompt, G")
    mini_batch_size: int = arg(
        0, "completions per optimizer step over all processes; 0: batch_size",
    )
    micro_batch_size: int = arg(4, "completions per forward/backward on each process")
    logprob_batch_size: int = arg(
        0, "completions per no-grad forward on each process; 0: micro_batch_size",
    )
    share_prompts: bool = arg(
        True,
        "the completions of a prompt share one forward of it (the HF engine's prefill, the no-grad "
        "log-prob passes); false: each row's whole prompt in the pass's one forward, as TRL",
    )
    num_iterations: int = arg(1, "passes over each batch of rollouts (mu)")
    learning_rate: float = arg(1e-6, "AdamW learning rate")
    lr_scheduler_type: str = arg("constant", "transformers scheduler name")
    warmup_steps: int = arg(0, "learning-rate warmup in optimizer steps")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "gradient clipping")
    # The estimator's KL coefficient, which common/ reads: the reference model is loaded and its
    # log-probs computed only when it is above 0. Each script's Args sets its own default (grpo.py
    # 0.04, TRL's 0.0) and help.
    beta: float = arg(0.0, "KL coefficient to the reference policy (0: no reference)", at_least=0)
    eval_steps: int = arg(50, "held-out greedy accuracy every this many steps (0: off)")
    eval_num_prompts: int = arg(500, "held-out prompts per evaluation")
    eval_from: int = arg(
        0, "the first step evaluated (0: before training too); later, every --eval_steps",
    )
    eval_benchmarks: str = arg(
        "", "benchmarks to evaluate, e.g. math500,aime25 (NAME=FILE: a local copy)",
    )
    eval_num_samples: int = arg(1, "samples per benchmark question, k of avg@k (1: greedy)")
    dump_stats_steps: int = arg(
        0, "save batch_stats' per-row tensors to run_dir/stats every this many steps (0: off)",
    )

    def problems(self, columns: list[str] | None = None) -> list[str]:
        """A script's own checks, one line each: of its flags, with the shared ones before anything
        loads (common/rails/checks.py), then of the training data's columns once they load, before
        the weights (common/run.py setup); a script's Args overrides it."""
        return []


class ArgParser(HfArgumentParser):
    """HfArgumentParser, which passes a field's metadata to argparse, less the keys that are not
    argparse's; a bad value is one line naming the flag, what it got and what it takes (argparse's
    own prints the whole usage). No abbreviations: `--learning_rat` is an unknown flag, not
    --learning_rate."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        # "--total_steps/--total-steps": the flag as written
        message = re.sub(r"(--\w+)/--[\w-]+", r"\1", message)
        raise SystemExit(f"error: {message}; --help lists the flags")

    @staticmethod
    def _parse_dataclass_field(parser, field: dataclasses.Field):
        if "at_least" in field.metadata:
            field = copy.copy(field)
            field.metadata = types.MappingProxyType(
                {k: v for k, v in field.metadata.items() if k != "at_least"})
        HfArgumentParser._parse_dataclass_field(parser, field)
        # %(default).0s: no "(default: ...)" added where it would mislead or repeat
        for action in parser._actions:
            # the `--no_X` twin of a flag on by default
            if f"--no_{field.name}" in action.option_strings:
                action.help = f"turn --{field.name} off%(default).0s"
            elif f"--{field.name}" in action.option_strings and "default" in (action.help or ""):
                action.help += "%(default).0s"  # its help already says what the default is


def parse_args(args_cls, argv: list[str] | None = None):
    """HfArgumentParser with layers of defaults under the command line: --preset NAME, then the
    run's own settings with --resume_from, then --config FILE.yaml. Read from the command line
    (`argv` None) on a machine without CUDA, the default model is refused unless asked for
    (`cpu_guard`)."""
    command_line = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config")
    pre.add_argument("--preset")
    pre.add_argument("--resume_from")
    known, _ = pre.parse_known_args(argv)
    recipe = {}
    if known.config is not None:
        from common.rails.recipes import read_recipe, script_problem

        recipe = read_recipe(known.config)
        problem = script_problem(known.config, getattr(args_cls, "exp_name", None))
        if problem:  # another estimator's?
            raise SystemExit(problem)
        fields = [f.name for f in dataclasses.fields(args_cls)]
        unknown = sorted(set(recipe) - set(fields))
        if unknown:
            from common.rails.flag_names import hint

            lines = [f"error: {known.config} sets {name!r}, not a field of {args_cls.__name__}"
                     for name in unknown]
            hints = [hint(name, fields, "") for name in unknown]
            lines = [f"{line}: {h}" if h else line for line, h in zip(lines, hints)]
            raise SystemExit("\n".join(lines))
    # --resume_from RUN alone: the run's own settings for every flag not given
    resumed = {}
    if known.resume_from:
        from common.rails.command_line import resumed_args

        resumed = resumed_args(known.resume_from, args_cls)
    # a recipe's preset: its defaults too
    preset = recipe.get("preset") if known.preset is None else known.preset
    if preset is None and known.config is None:
        preset = resumed.get("preset")
    if preset is not None and preset not in PRESET_NAMES:
        raise SystemExit(
            f"error: unknown --preset {preset!r}; choose one of {sorted(PRESET_NAMES)}")
    # the command line wins over --config, which wins over the resumed run's settings, which win
    # over --preset
    # (a preset's values of flags this script lacks, such as the toy's sdpo.py templates, stay out)
    own = {f.name for f in dataclasses.fields(args_cls)}
    values = {k: v for k, v in preset_defaults(preset).items() if k in own}
    defaults = {**values, **resumed, **recipe}
    script = sys.modules.get(args_cls.__module__)
    parser = ArgParser(args_cls,
                       description=((script.__doc__ or "").strip().splitlines() or [None])[0],
                       epilog="Each flag is a field of the script's Args; the command line wins "
                              "over --config, which wins over --preset.")
    # read above; listed here for --help only
    parser.add_argument("--config", default=argparse.SUPPRESS,
                        help="a YAML recipe of Args fields (configs/recipes/; docs/replicating.md)")
    parser.set_defaults(**defaults)
    if "-h" in argv or "--help" in argv:  # headings, each flag once, the preset's values
        from common.rails.help import arrange

        arrange(parser, args_cls, TrainArgs, preset, preset_defaults(preset))
    i = argv.index("--config") if "--config" in argv else None
    rest = argv if i is None else argv[:i] + argv[i + 2 :]
    args, unknown = parser.parse_args_into_dataclasses(
        args=[a for a in rest if not a.startswith("--config=")], return_remaining_strings=True)
    if unknown:
        raise SystemExit(f"error: unknown arguments "
                         f"{' '.join(unknown)}{did_you_mean(unknown, args_cls, ('config',))}; "
                         f"--help lists the flags")
    # argparse checked the command line's values; a YAML file's reach the dataclass as they are
    if recipe:
        from common.rails.recipes import type_problems

        problems = type_problems(args, recipe, known.config)
        if problems:
            raise SystemExit("\n".join(f"error: {p}" for p in problems))
    # after the flags' own errors; an Args without a model (a test's) has none to guard
    if (command_line and preset is None and "model" not in {**recipe, **resumed}
            and "model" in {f.name for f in dataclasses.fields(args_cls)}
            and not any(a.split("=")[0] in ("--model", "-h", "--help") for a in argv)):
        from common.rails.command_line import cpu_guard

        cpu_guard(args.model, PRESET_NAMES)
    return args


def parse_flags(args_cls, argv: list[str] | None = None):
    """The command line alone into `args_cls`, for tools that have no presets, recipes or runs to
    resume (evals/run.py): --help lists only their own flags; an unknown flag is one line."""
    script = sys.modules.get(args_cls.__module__)
    parser = ArgParser(args_cls,
                       description=((script.__doc__ or "").strip().splitlines() or [None])[0])
    args, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        raise SystemExit(f"error: unknown arguments "
                         f"{' '.join(unknown)}{did_you_mean(unknown, args_cls)}; "
                         f"--help lists the flags")
    return args


def did_you_mean(unknown: list[str], args_cls, others: tuple[str, ...] = ()) -> str:
    """What to pass instead of the unknown flags: the flag a name from TRL or a habit is here
    (`--lr`: --learning_rate), else the closest of the fields and `others`
    (common/rails/flag_names.py)."""
    from common.rails.flag_names import hint

    fields = [f.name for f in dataclasses.fields(args_cls)] + list(others)
    flags = [u.split("=")[0] for u in unknown if u.startswith("--")]
    hints = {flag: hint(flag, fields) for flag in flags if hint(flag, fields)}
    if len(flags) == 1 and hints:
        return f" ({hints[flags[0]]})"
    return f" ({'; '.join(f'{flag}: {h}' for flag, h in hints.items())})" if hints else ""
