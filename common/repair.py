"""What a killed or starved run leaves behind: a .jsonl file ending in half a line, a checkpoint
save that filled the disk. Imported only then: on --resume_from (common/checkpoints.py MetricsLog,
common/resume.py), when a save fails."""

import errno
import json
import shutil

from common.args import warn


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


def disk_full(error: Exception, tmp: str, final: str, last: str | None, run_dir: str) -> None:
    """A checkpoint save that filled the disk (OSError ENOSPC, or torch.save's RuntimeError saying
    so): the unfinished copy removed, one line; the checkpoints before it are untouched. Any other
    error: returns, to be raised."""
    if getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error):
        shutil.rmtree(tmp, ignore_errors=True)
        raise SystemExit(f"error: no space left on device while saving {final}; the last good "
                         f"checkpoint is {last or 'none'}: free space (or keep fewer with "
                         f"--save_total_limit) and resume with --resume_from {run_dir}") from None
