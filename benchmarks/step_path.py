"""The files a student opens to follow one training step: every repository function one warm step calls.

Runs a script's `main` on the toy (3 steps, no evaluation, no checkpoint) under Python's profiler and records
each function of the repository that the second step calls, besides the script's own and besides `end_step`
(the bookkeeping after the update: pushing weights, logging, evaluating, saving) and what it calls. The first
step is left out: it builds what later steps reuse (caches, the engine's first call).

    python benchmarks/step_path.py grpo.py            # from a folder holding runs/toy
    python benchmarks/step_path.py grpo.py --json     # the same, as JSON

grpo.py's docstring names the files this prints; tests/test_siblings.py holds the two equal.
"""

import argparse
import collections
import json
import os
import runpy
import sys
import threading

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_FLAGS = ["--preset", "toy", "--total_steps", "3", "--eval_steps", "0", "--save_steps", "0",
              "--report_to", "none"]


def step_path(script: str, run_name: str = "step_path") -> dict[str, list[str]]:
    """{file: sorted function names} of the repository functions the second step of `script` calls,
    end_step's subtree and the script's own functions aside."""
    calls = collections.defaultdict(set)
    state = {"steps_ended": 0, "in_end_step": 0}

    def profile(frame, event, arg):
        if event not in ("call", "return"):
            return
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(REPO + os.sep):
            return
        name = frame.f_code.co_name
        if name == "end_step":
            if event == "call":
                state["in_end_step"] += 1
                state["steps_ended"] += 1
            else:
                state["in_end_step"] -= 1
            return
        rel = os.path.relpath(path, REPO)
        if event == "call" and state["steps_ended"] == 1 and not state["in_end_step"] and rel != script:
            calls[rel].add(name)

    argv = sys.argv
    sys.argv = [script, *STEP_FLAGS, "--run_name", run_name]
    sys.path.insert(0, REPO)
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        runpy.run_path(os.path.join(REPO, script), run_name="__main__")
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        sys.argv = argv
    return {rel: sorted(names) for rel, names in sorted(calls.items())}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("script", help="an estimator script, e.g. grpo.py")
    p.add_argument("--json", action="store_true", help="print {file: functions} as JSON")
    p.add_argument("--run_name", default="step_path")
    a = p.parse_args(argv)
    path = step_path(a.script, a.run_name)
    if a.json:
        print(json.dumps(path))
        return path
    for rel, names in path.items():
        print(f"{rel}: {len(names)} functions: {', '.join(names)}")
    print(f"{len(path)} files besides {a.script}")
    return path


if __name__ == "__main__":
    main()
