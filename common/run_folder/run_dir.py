"""The run folder: claimed by one run at a time and never overwritten; a resume continues its own
run's folder.

`claim_run_dir` (all processes; the main one decides) returns the folder and the checkpoint to
resume from; the folder's `.lock` is held by the main process until it exits; `record_args` keeps
the settings of every start.
"""

import fcntl
import json
import os
import socket
import time

from accelerate import PartialState
from accelerate.utils import broadcast_object_list

from common.run_folder.checkpoints import latest_checkpoint

LOCK = ".lock"
# run folder -> the open lock file of this process (released when it exits)
_held_locks: dict[str, int] = {}


def claim_run_dir(args, run_name: str) -> tuple[str, str | None]:
    """The run's folder, locked for this run by the main process, and the checkpoint to resume from
    (or None): a new folder (refused if another run's files are in it) or, with --resume_from, the
    resumed run's (refused if its settings changed without --resume_overrides). The verdict is
    broadcast, so all processes stop together."""
    outcome = [None, None, None]  # run folder, checkpoint, error
    if PartialState().is_main_process:
        try:
            outcome[:2] = _claim(args, run_name)
        except SystemExit as e:
            outcome[2] = str(e)
    broadcast_object_list(outcome)
    if outcome[2]:
        raise SystemExit(outcome[2])
    return outcome[0], outcome[1]


def _claim(args, run_name: str) -> tuple[str, str | None]:
    # its latest intact checkpoint, its folder locked, its settings kept:
    # common/run_folder/resume.py
    if args.resume_from:
        from common.run_folder.resume import check_resume, find_checkpoint

        resume = find_checkpoint(args.resume_from)
        run_dir = os.path.dirname(os.path.dirname(resume))
        lock_run_dir(run_dir)
        try:
            check_resume(run_dir, args)
        except SystemExit:
            release_run_dir(run_dir)
            raise
        return run_dir, resume
    run_dir = os.path.join(args.output_dir, run_name)
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"error: cannot make the run folder {run_dir!r} ({e.strerror}); pass "
                         f"another --output_dir or --run_name") from None
    lock_run_dir(run_dir)
    used = sorted(set(os.listdir(run_dir)) - {LOCK})
    if used:
        release_run_dir(run_dir)
        again = f", continue it with --resume_from {run_dir}" if latest_checkpoint(run_dir) else ""
        raise SystemExit(f"error: the run folder {run_dir} is in use "
                         f"({', '.join(used[:4])}{', ...' if len(used) > 4 else ''}); pass another "
                         f"--run_name{again}, or delete the folder")
    return run_dir, None


def lock_run_dir(run_dir: str) -> None:
    """An exclusive flock on run_dir/.lock, held until this process exits (the kernel drops it then,
    so a crashed run leaves no stale lock) or claims another folder (one run at a time per process:
    tests run several)."""
    for held in list(_held_locks):
        release_run_dir(held)
    fd = os.open(os.path.join(run_dir, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.read(fd, 200).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise SystemExit(f"error: the run folder {run_dir} is locked by a run in progress "
                         f"({owner}); wait for it to end, or pass another --run_name") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
    _held_locks[run_dir] = fd


def release_run_dir(run_dir: str) -> None:
    fd = _held_locks.pop(run_dir, None)
    if fd is not None:
        os.close(fd)  # closing the file drops the flock


def record_args(run_dir: str, args: dict, step: int) -> None:
    """args.json holds the settings the run started with (never rewritten); args_history.jsonl gets
    one line per start, {"time", "step", "args"}, so a resume with --resume_overrides leaves a
    trace."""
    if not os.path.exists(os.path.join(run_dir, "args.json")):
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump(args, f, indent=1)
    with open(os.path.join(run_dir, "args_history.jsonl"), "a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "step": step, "args": args})
                + "\n")
