"""--resume_from: find an intact checkpoint, and refuse a resume whose settings changed (imported
only then)."""

import json
import os

from accelerate import PartialState

from common.metrics import warn
from common.run_folder.checkpoints import MANIFEST, checkpoint_steps
from common.run_folder.repair import json_lines

# Settings a resumed run may change without --resume_overrides: they change neither the data, the
# samples' distribution, the optimisation nor the estimator (micro-batching and process count are
# tested invariances).
RESUME_MAY_CHANGE = {"run_name", "output_dir", "resume_from", "resume_overrides", "preset",
                     "report_to", "save_steps", "save_total_limit", "eval_steps", "eval_from",
                     "eval_num_prompts", "eval_benchmarks", "eval_num_samples", "dump_stats_steps",
                     "micro_batch_size", "logprob_batch_size", "gradient_checkpointing",
                     "gradient_checkpointing_every", "rollout_engine",
                     "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
                     "max_logp_gap", "server_url", "server_timeout", "reward_timeout"}
# total_steps does not shape their learning rate
SCHEDULES_WITHOUT_END = {"constant", "constant_with_warmup"}


def resume_problems(args) -> list[str]:
    """Before any weights load: --resume_from (which common/rails/checks.py argument_problems found
    to exist) holds an intact checkpoint."""
    try:
        ckpt = find_checkpoint(args.resume_from)  # a damaged checkpoint, or none
    except SystemExit as e:
        return [str(e).removeprefix("error: ")]
    return ahead_problems(ckpt, PartialState().num_processes)


def ahead_problems(ckpt: str, num_processes: int) -> list[str]:
    """The batches sampled ahead (--rollout_lag K) are saved by each process, its own rows: a resume
    under another process count would give the processes rows of the wrong shape, and abort in a
    collective. Refused instead."""
    state = os.path.join(ckpt, "state")
    saved = []
    if os.path.isdir(state):
        saved = [f for f in os.listdir(state)
                 if f.startswith(("rollout_queue_", "rollout_requests_"))]
    if saved and len(saved) != num_processes:
        return [f"--resume_from: {ckpt} holds the batches sampled ahead of it (--rollout_lag) by "
                f"{len(saved)} process{'es' if len(saved) > 1 else ''}, and this run has "
                f"{num_processes}: resume with {len(saved)} (accelerate launch --num_processes "
                f"{len(saved)}), or start a new run"]
    return []


def checkpoint_damage(ckpt: str) -> str | None:
    """Why a checkpoint cannot be resumed from (a file missing, truncated or unreadable), or None.
    Checks the sizes its manifest recorded (older checkpoints without one: no empty file) and the
    header of every safetensors file."""
    from safetensors import safe_open

    try:
        with open(os.path.join(ckpt, MANIFEST)) as f:
            expected = json.load(f)
    except (OSError, ValueError):
        expected = {os.path.relpath(os.path.join(d, f), ckpt): None for d, _, names in os.walk(ckpt)
                    for f in names}
    for name, size in sorted(expected.items()):
        path = os.path.join(ckpt, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) != size and (size is not None or os.path.getsize(path) == 0):
            return f"{name} has {os.path.getsize(path)} bytes, {size or 'more'} expected"
        if name.endswith(".safetensors"):
            try:
                with safe_open(path, "pt"):
                    pass
            except Exception as e:
                return f"{name} cannot be read ({str(e).splitlines()[0]})"
    return None


def find_checkpoint(path: str) -> str:
    """A checkpoint folder, or a run folder (its latest intact checkpoint, with a warning when a
    later one is damaged). A damaged checkpoint is refused with the reason: resuming from it would
    crash inside load_state."""
    if os.path.isdir(os.path.join(path, "state")):
        damage = checkpoint_damage(path)
        if damage:
            raise SystemExit(f"error: --resume_from {path!r} is damaged: {damage}; pass the run "
                             f"folder to resume from its latest intact checkpoint, or an earlier "
                             f"checkpoints/step_N")
        return path
    ckpt_dir = os.path.join(path, "checkpoints")
    steps = checkpoint_steps(path)
    if not steps:
        raise SystemExit(f"error: --resume_from {path!r} is neither a checkpoint (no state/ "
                         f"inside) nor a run folder with complete checkpoints under "
                         f"checkpoints/step_N")
    for step in reversed(steps):
        ckpt = os.path.join(ckpt_dir, f"step_{step}")
        damage = checkpoint_damage(ckpt)
        if damage is None:
            return ckpt
        warn(f"checkpoint {ckpt} is damaged ({damage}); trying the one before it")
    raise SystemExit(f"error: --resume_from {path!r}: every checkpoint under {ckpt_dir} is damaged")


def recorded_args(run_dir: str) -> dict | None:
    """The settings of the run's latest start: the last line of args_history.jsonl, else
    args.json."""
    history = os.path.join(run_dir, "args_history.jsonl")
    if os.path.isfile(history):
        lines = json_lines(history)
        if lines:
            return lines[-1]["args"]
    if os.path.isfile(os.path.join(run_dir, "args.json")):
        with open(os.path.join(run_dir, "args.json")) as f:
            return json.load(f)
    return None


def check_resume(run_dir: str, args) -> None:
    """A resumed run continues the same experiment: refuse changed data, geometry, optimisation or
    estimator settings unless --resume_overrides names each of them."""
    old = recorded_args(run_dir)
    if old is None:
        warn(f"{run_dir} has no args.json: cannot check that the resumed run keeps its settings")
        return
    may_change = set(RESUME_MAY_CHANGE) | set(filter(None, args.resume_overrides.split(",")))
    if old.get("lr_scheduler_type") in SCHEDULES_WITHOUT_END:
        may_change.add("total_steps")
    new = {k: v for k, v in vars(args).items()}
    changed = [k for k in new if k in old and k not in may_change and old[k] != new[k]]
    if changed:
        what = ", ".join(f"--{k} {old[k]!r} -> {new[k]!r}" for k in changed)
        raise SystemExit(f"error: --resume_from {run_dir}: {what} changed since the run "
                         f"started; a resume continues the same run: pass the run's "
                         f"values, or --resume_overrides {','.join(changed)} to change "
                         f"them anyway, or start a new run")
    overridden = [k for k in filter(None, args.resume_overrides.split(","))
                  if k in old and old[k] != new[k]]
    if overridden:
        warn(f"resuming {run_dir} with changed "
             + ", ".join(f"--{k} {old[k]!r} -> {new[k]!r}" for k in overridden))
