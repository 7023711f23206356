"""How long a refusal takes: the seconds from `python grpo.py BAD-ARGS` to its one-line error, for
errors found in the arguments and files alone (issue 68, item 6), beside the floor of Python and of
`import torch`.

    python benchmarks/refusal_latency.py                        # every case, 3 runs each
    python benchmarks/refusal_latency.py --repeat 1 --cases unknown_flag,range

Each run is a new process in an empty folder (a bad flag is refused before a preset builds
anything), with CUDA hidden and the hub offline; wall seconds depend on how busy the machine is,
CPU seconds (the process's user + system time) much less. Prints a table and writes
runs/benchmarks/refusal_latency.json.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "grpo.py")
# name: (the command's arguments after `python`, a part of the error line it must end with)
CASES = {
    "python": (["-c", "pass"], None),
    "import_torch": (["-c", "import torch"], None),
    "unknown_flag": ([SCRIPT, "--preset", "toy", "--lr", "1e-5"], "did you mean --learning_rate?"),
    "bad_type": ([SCRIPT, "--preset", "toy", "--total_steps", "ten"], "invalid int value: 'ten'"),
    "config_field": ([SCRIPT, "--preset", "toy", "--config", "trl.yaml"], "not a field of Args"),
    "range": ([SCRIPT, "--preset", "toy", "--top_p", "1.5"], "--top_p 1.5 must be in (0, 1]"),
    "missing_model": (
        [SCRIPT, "--model", "./no/such/model", "--report_to", "none"],
        "no such directory",
    ),
}


def run_once(argv: list[str], folder: str) -> dict:
    """One process: its wall and CPU seconds, exit code and last line of stderr."""
    env = {**os.environ, "PYTHONPATH": REPO, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, *argv], cwd=folder, env=env, capture_output=True, text=True, timeout=600
    )
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = done.stderr.strip().splitlines()
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "returncode": done.returncode,
        "line": lines[-1] if lines else "",
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs of each case")
    parser.add_argument(
        "--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES)
    )
    parser.add_argument("--out", default=os.path.join("runs", "benchmarks", "refusal_latency.json"))
    given = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(given)
    results = []
    for name in args.cases.split(","):
        command, expected = CASES[name]
        runs = []
        for _ in range(args.repeat):
            with tempfile.TemporaryDirectory() as folder:
                with open(os.path.join(folder, "trl.yaml"), "w") as f:
                    f.write("per_device_train_batch_size: 4\n")  # a field of TRL's GRPOConfig
                runs.append(run_once(command, folder))
        refused = expected is not None
        ok = all(
            (r["returncode"] == 1 and expected in r["line"]) if refused else r["returncode"] == 0
            for r in runs
        )
        results.append(
            {
                "case": name,
                "argv": command[1:] if refused else command,
                "ok": ok,
                "line": runs[-1]["line"],
                "median_wall_s": statistics.median(r["wall_s"] for r in runs),
                "median_cpu_s": statistics.median(r["cpu_s"] for r in runs),
                "runs": runs,
            }
        )
        print(
            f"{name:15s} wall {results[-1]['median_wall_s']:6.2f} s  "
            f"cpu {results[-1]['median_cpu_s']:6.2f} s  {'ok' if ok else 'UNEXPECTED'}  "
            f"{runs[-1]['line'][:60]}",
            flush=True,
        )
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(
            {
                "command": " ".join(["python", "benchmarks/refusal_latency.py", *given]),
                "repeat": args.repeat,
                "results": results,
            },
            f,
            indent=1,
        )
    return results


if __name__ == "__main__":
    main()
