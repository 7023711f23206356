"""ruff over the whole project (ruff.toml: pycodestyle with 120-character lines, pyflakes, import order)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ruff_check_passes():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", REPO], capture_output=True, text=True,
                          cwd=REPO)
    assert proc.returncode == 0, f"ruff check found problems (fix them, or `ruff check --fix`):\n{proc.stdout}"
