"""What a killed or starved run leaves behind: a .jsonl file ending in half a line, a checkpoint
save that filled the disk. Imported only then: on --resume_from (common/run_folder/checkpoints.py
MetricsLog, common/run_folder/resume.py), when a save fails."""

import contextlib
import errno
import json
import os
import shutil

from common.metrics import warn


def json_lines(path: str) -> list[dict]:
    """The lines of a .jsonl file that read; a line a killed run left half written is dropped, with
    a warning."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            kept.append(json.loads(line))
        except ValueError:
            warn(f"{path} line {number} is not whole JSON (a run killed while writing it?); "
                 f"dropped: {line[:80]!r}")
    return kept


def metrics_until(path: str, step: int) -> list[str]:
    """metrics.jsonl's lines up to the resumed checkpoint's step, each whole, to write back."""
    return [json.dumps(m) + "\n" for m in json_lines(path) if m["step"] <= step]


# Each way the OS says a save ran out of room: what to tell the user, and the fix.
SPACE_ERRORS = {
    errno.ENOSPC: ("no space left on device", "free space (or keep fewer with --save_total_limit)"),
    errno.EDQUOT: (
        "disk quota exceeded",
        "free space in the quota (or keep fewer with --save_total_limit)",
    ),
    errno.EFBIG: (
        "a file reached the file size limit (ulimit -f)",
        "raise the limit (ulimit -f unlimited)",
    ),
}
PROBE_BYTES = 1 << 20  # a disk that filled during a write has less than this left


def disk_full(error: Exception, tmp: str, final: str, last: str | None, run_dir: str) -> None:
    """A checkpoint save that ran out of room (a full disk, a quota, a file size limit): the
    unfinished copy removed, one line; the checkpoints before it are untouched. Any other error:
    returns, to be raised."""
    number = space_errno(error)
    if number is None:
        number = probe_space(tmp)
    if number is None:
        return
    shutil.rmtree(tmp, ignore_errors=True)
    reason, fix = SPACE_ERRORS[number]
    raise SystemExit(f"error: {reason} while saving {final}; the last good checkpoint is "
                     f"{last or 'none'}: {fix} "
                     f"and resume with --resume_from {run_dir}") from None


def space_errno(error: BaseException | None) -> int | None:
    """ENOSPC, EDQUOT or EFBIG where the error, or an error it was raised from, says so by its errno
    or its text (safetensors' SafetensorError names it only in its text), else None."""
    while error is not None:
        if getattr(error, "errno", None) in SPACE_ERRORS:
            return error.errno
        for number in SPACE_ERRORS:
            if os.strerror(number) in str(error):
                return number
        error = error.__cause__ or error.__context__
    return None


def probe_space(tmp: str) -> int | None:
    """Asks the file system why a save failed when the error does not say: torch.save's writer drops
    the errno and raises "[enforce fail at inline_container.cc:672] . unexpected pos 480704 vs
    480596" (docs/notes.md). EFBIG when a file of the save reached this process's file size limit;
    else the errno of writing PROBE_BYTES beside the save when that fails for lack of space (ENOSPC,
    EDQUOT); None when there is room."""
    import resource

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    sizes = [os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(tmp) for f in names]
    if limit != resource.RLIM_INFINITY and any(size >= limit for size in sizes):
        return errno.EFBIG
    folder = tmp
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    probe = os.path.join(folder, f".space_probe_{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(bytes(PROBE_BYTES))
    except OSError as e:
        return e.errno if e.errno in SPACE_ERRORS else None
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)
    return None
