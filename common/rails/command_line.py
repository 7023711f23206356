"""What parse_args (common/args.py) adds for two cases of the command line, imported only then: the
settings of the run a bare `--resume_from runs/X` continues, and the stop of `python grpo.py` (the
default model) on a machine without CUDA."""

import dataclasses
import json
import os


def cpu_guard(model: str, presets: tuple[str, ...]) -> None:
    """`python grpo.py` with no preset and no model asked for (on the command line, in --config, or
    the resumed run's: common/args.py parse_args looks) would load the default model, Qwen3-4B, onto
    a machine's CPU where it has no CUDA: stopped in one line naming the presets that run there."""
    import torch

    if not torch.cuda.is_available():
        names = ", ".join(presets)
        raise SystemExit(f"error: no GPU here (CUDA is not available) for the default --model "
                         f"{model}: pass --preset with one that runs on a CPU ({names}), "
                         f"or --model to run a model of your choice anyway")


# settings a resume does not take from the run: the command line's own (resume_overrides: each
# resume names its own), and the script's (exp_name: another script's run is refused, not joined)
NOT_RESUMED = {"resume_from", "resume_overrides", "exp_name"}


def last_start(run_dir: str) -> dict:
    """The settings of the run's latest start: the last whole line of args_history.jsonl, else
    args.json, else {} (common/run_folder/resume.py recorded_args reads them the same way for its
    checks, and warns about a line a killed run left half written)."""
    history = os.path.join(run_dir, "args_history.jsonl")
    if os.path.isfile(history):
        with open(history) as f:
            for line in reversed([line for line in f if line.strip()]):
                try:
                    return json.loads(line)["args"]
                except (ValueError, KeyError, TypeError):
                    continue
    try:
        with open(os.path.join(run_dir, "args.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def resumed_args(path: str, args_cls) -> dict:
    """The settings the run at `path` (a run folder, or one of its checkpoints/step_N) last started
    with (args_history.jsonl, else args.json), for this script's fields; {} where there are none
    (common/run_folder/resume.py then says what is wrong with the path)."""
    run_dir = path.rstrip("/")
    if os.path.isdir(os.path.join(run_dir, "state")):  # a checkpoint: runs/X/checkpoints/step_N
        run_dir = os.path.dirname(os.path.dirname(run_dir))
    if not os.path.isdir(run_dir):
        return {}
    recorded = last_start(run_dir)
    fields = {f.name for f in dataclasses.fields(args_cls)}
    return {k: v for k, v in recorded.items() if k in fields and k not in NOT_RESUMED}
