"""Checkpoints and the metrics log: what a run leaves in its folder.

    save_checkpoint(...)   checkpoints/step_N/{state,model}, written whole or not at all, never with
                           NaN weights
    MetricsLog             metrics.jsonl, one line per step (cut back to the checkpoint on resume)
    run_summary(...)       the lines printed at the end of a run

Reading a checkpoint back (and checking it is intact) is common/run_folder/resume.py's, imported
with --resume_from."""

import contextlib
import json
import logging
import os
import re
import shutil
import time

import torch


class TrainState:
    """The loop position, saved with accelerator.save_state so a resumed run continues exactly."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def save_checkpoint(accelerator, model, tokenizer, run_dir: str, step: int,
                    save_total_limit: int = 0, queue=None) -> str:
    """`run_dir/checkpoints/step_N/{state,model}`: accelerate state (to resume) and save_pretrained
    weights (merged for LoRA, to evaluate or serve). Written to a temporary folder and renamed when
    complete, so an interrupted save never leaves a half checkpoint behind that looks complete.
    Non-finite weights are never written; with `save_total_limit` N > 0 only the last N checkpoints
    are kept. Each process saves its own rows of the rollout `queue` (common.sampling.RolloutQueue)
    in the state folder."""
    final = os.path.join(run_dir, "checkpoints", f"step_{step}")
    tmp = final + ".tmp"
    # each process counts its own parameters (its shards under FSDP), the sum tells every process
    # the same
    nonfinite = sum(float((~torch.isfinite(p.detach())).sum()) for p in model.parameters())
    nonfinite = accelerator.reduce(torch.tensor(nonfinite, device=accelerator.device), "sum").item()
    if nonfinite:
        raise SystemExit(f"error: step {step}: {int(nonfinite)} weights are not finite; refusing "
                         f"to save them; the last good checkpoint is "
                         f"{latest_checkpoint(run_dir) or 'none (see --save_steps)'}")
    try:
        if accelerator.is_main_process and os.path.exists(tmp):
            shutil.rmtree(tmp)
        accelerator.wait_for_everyone()
        unwrapped = accelerator.unwrap_model(model)
        with quiet_saves(unwrapped):
            accelerator.save_state(os.path.join(tmp, "state"))
            if queue is not None:
                queue.save(os.path.join(tmp, "state"), accelerator.process_index)
            state_dict = accelerator.get_state_dict(model)  # gathers ZeRO-3 / FSDP shards
            if accelerator.is_main_process:
                # peft: save the adapter and the merged model
                if hasattr(unwrapped, "merge_and_unload"):
                    unwrapped.save_pretrained(os.path.join(tmp, "adapter"), state_dict=state_dict)
                    from common.models.lora import merged_copy

                    merged = merged_copy(unwrapped)
                    merged.save_pretrained(os.path.join(tmp, "model"))
                else:
                    unwrapped.save_pretrained(os.path.join(tmp, "model"), state_dict=state_dict)
                tokenizer.save_pretrained(os.path.join(tmp, "model"))
        # every process's files are in tmp before it becomes the checkpoint
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            write_manifest(tmp)
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            if save_total_limit > 0:
                for old in checkpoint_steps(run_dir)[:-save_total_limit]:
                    shutil.rmtree(os.path.join(run_dir, "checkpoints", f"step_{old}"))
    # no room left stops in one line (common/run_folder/repair.py disk_full), anything else as it is
    except Exception as e:
        from common.run_folder.repair import disk_full

        disk_full(e, tmp, final, latest_checkpoint(run_dir), run_dir)
        raise
    accelerator.wait_for_everyone()
    return final


class _TiedWeightsFilter(logging.Filter):
    """Drops accelerate's "Removed shared tensor {...}" when every name in it is a weight the model
    ties on purpose (e.g. lm_head.weight = embed_tokens.weight): from_pretrained re-ties them, so
    the warning is noise at every save. The same warning about any other shared tensor still shows.
    """

    def __init__(self, tied: set[str]):
        super().__init__()
        self.tied = tied

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()  # accelerate's logger may prefix "[RANK 0] "
        if "Removed shared tensor" not in message:
            return True
        names = set(re.findall(r"'([^']+)'", message.split(" while saving")[0]))
        return not names or not names <= self.tied


@contextlib.contextmanager
def quiet_saves(model):
    """No per-checkpoint noise: the tied-weights warning (twice per save) and transformers' "Writing
    model shards" progress bar; every other warning stays."""
    from transformers.utils import logging as hf_logging

    seen, tied = {}, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        key = (p.data_ptr(), p.shape)
        if key in seen and p.numel() > 0:  # sharded placeholders (numel 0) are not ties
            tied.update({name, seen[key], re.sub(r"^(base_model\.model\.|module\.)", "", name)})
        seen.setdefault(key, name)
    log_filter, logger = _TiedWeightsFilter(tied), logging.getLogger("accelerate.utils.other")
    bars_were_on = hf_logging.is_progress_bar_enabled()
    logger.addFilter(log_filter)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        logger.removeFilter(log_filter)
        if bars_were_on:
            hf_logging.enable_progress_bar()


def checkpoint_steps(run_dir: str) -> list[int]:
    """The steps of the run's complete checkpoints, in order (a .tmp folder is an interrupted save).
    """
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(int(d.split("_")[1]) for d in os.listdir(ckpt_dir) if d.startswith("step_") and
                  not d.endswith(".tmp"))


def latest_checkpoint(run_dir: str) -> str | None:
    """The run's last complete checkpoint folder (not checked for damage:
    common.run_folder.resume.find_checkpoint does), or None."""
    steps = checkpoint_steps(run_dir)
    return os.path.join(run_dir, "checkpoints", f"step_{steps[-1]}") if steps else None


MANIFEST = "manifest.json"  # in each checkpoint: every file's size, written last (save_checkpoint)


def write_manifest(ckpt: str) -> None:
    files = {os.path.relpath(os.path.join(d, f), ckpt): os.path.getsize(os.path.join(d, f))
             for d, _, names in os.walk(ckpt) for f in names}
    with open(os.path.join(ckpt, MANIFEST), "w") as f:
        json.dump(files, f, indent=0, sort_keys=True)


class MetricsLog:
    """metrics.jsonl in the run folder (main process only): one line per step; on resume, the lines
    after the checkpoint's step are dropped, so the file reads as if the run had never stopped."""

    def __init__(self, run_dir: str, enabled: bool, resume_step: int = 0):
        self.path, self.enabled = os.path.join(run_dir, "metrics.jsonl"), enabled
        self.run_dir, self.start, self.resume_step = run_dir, time.time(), resume_step
        if not enabled:
            return
        kept = []  # a new run starts in an empty folder (common.run_folder.run_dir.claim_run_dir)
        if resume_step and os.path.exists(self.path):  # less a line a killed run left half written
            from common.run_folder.repair import metrics_until

            kept = metrics_until(self.path, resume_step)
        with open(self.path, "w") as f:
            f.writelines(kept)

    def write(self, metrics: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(metrics) + "\n")

    def print_summary(self) -> None:
        """What the run did, printed once at its end (main process): see run_summary."""
        if self.enabled:
            print(run_summary(self.run_dir, time.time() - self.start, self.resume_step), flush=True)


def format_seconds(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def run_summary(run_dir: str, seconds: float, resume_step: int = 0) -> str:
    """A few lines for the terminal at the end of a run: held-out accuracy and each benchmark score
    at the first and the last evaluation, steps, wall time, the run folder, the final checkpoint and
    the commands that go on from it (evaluate, plot, resume). Everything comes from metrics.jsonl
    and the checkpoints folder."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    steps = max((m["step"] for m in lines), default=0)
    this_run = f"steps {resume_step} -> {steps}" if resume_step else f"{steps} steps"
    out = [f"\n=== {os.path.basename(run_dir)}: {this_run} in {format_seconds(seconds)}"]
    evals = sorted({k for m in lines for k in m
                    if k.startswith("eval/") and isinstance(m[k], (int, float))},
                   key=lambda k: (k != "eval/accuracy", k.count("/"), k))
    for key in evals:
        seen = [(m["step"], m[key]) for m in lines if key in m]
        (first_step, first), (last_step, last) = seen[0], seen[-1]
        change = (f"{first:.1%} (step {first_step}) -> {last:.1%} (step {last_step}), "
                  f"{100 * (last - first):+.1f} points")
        out.append(f"{key + ':':34s}"
                   f"{change if len(seen) > 1 else f'{last:.1%} (step {last_step})'}")
    if not evals:
        out.append("no held-out evaluation (--eval_steps 0, or no eval data)")
    done = checkpoint_steps(run_dir)
    out.append(f"{'run folder:':34s}{run_dir}  (metrics.jsonl, args.json)")
    if done:
        final = os.path.join(run_dir, "checkpoints", f"step_{done[-1]}")
        model = os.path.join(final, "model")
        out += [f"{'final checkpoint:':34s}{final}",
                f"{'evaluate it:':34s}python -m evals.run --model {model} --benchmarks ...",
                f"{'resume:':34s}add --resume_from {run_dir}"]
    out.append(f"{'plot:':34s}python -m evals.plot {run_dir}")
    return "\n".join(out)
