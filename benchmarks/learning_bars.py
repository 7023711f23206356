"""The spread of each estimator's learning test over seeds and toys: where its bar comes from.

Every `test_toy_learns` runs `X.py --preset toy --total_steps 50 --eval_steps 25` (seed 1) and asserts that held-out
greedy accuracy rises by at least a bar. This runs the same command for each estimator, seed and toy, and prints the
gain (accuracy at step 50 less accuracy at step 0) with its mean and standard deviation, per toy and over all
runs of an estimator. tests/data/learning_bars.json is its output; the learning tests take their bar from it
(tests/conftest.py learning_bar): each toy is named by the sha256 of its weights, since a toy's warm start depends
on the CPU that built it, and the gains depend on the toy far more than on the seed.

    python benchmarks/learning_bars.py --toys runs/toy,runs/toy_seed1 --seeds 3 \
        --out tests/data/learning_bars.json                                        # 84 runs of ~40 s
    python benchmarks/learning_bars.py --algos landscape --toys runs/toy,runs/toy_seed1 --seeds 3 \
        --out tests/data/learning_bars.json --merge                    # a new estimator's runs, the others kept
    python benchmarks/learning_bars.py --algos grpo --seeds 1 --extra "--total_steps 2 --eval_steps 2"  # smoke

Each run is a process of its own in a folder holding its toy (runs/learning_bars/<toy>/), one thread each,
`--jobs` at a time. A run whose metrics.jsonl already has its last evaluation is read, not run again, and its
checkpoints are not kept (`--save_steps 0`): the study can stop and resume.
"""

import argparse
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from evals import ALGORITHMS  # noqa: E402

# The flags of each estimator's test_toy_learns besides the shared ones (tests/test_covpo.py runs both methods).
VARIANTS = {"covpo": [("covpo_clip", ["--cov_method", "clip"]), ("covpo_kl", ["--cov_method", "kl"])]}
VARIANTS["gdpo"] = [("gdpo", ["--reward_funcs", "toy_addition,toy_closeness"])]  # two rewards: GDPO's case
# landscape.py with no switch is grpo.py to the bit: its test learns with CL, the paper's sign advantages
VARIANTS["landscape"] = [("landscape", ["--advantage", "sign"])]
# sdpo.py: the toy's own templates (its vocabulary has no letters), a tenth of the distillation term beside GRPO's
# (the distillation term alone collapses the toy: docs/estimators/sdpo.md), 100 steps (at 50 the seed-1 toy gained
# +0.021 +- 0.023: the distillation term slows the start)
VARIANTS["sdpo"] = [("sdpo", ["--distillation_weight", "0.1", "--reprompt_template", "{prompt}{solution}={prompt}",
                              "--solution_template", "{successful_previous_attempt}", "--total_steps", "100",
                              "--eval_steps", "50"])]
COMMON = ["--preset", "toy", "--total_steps", "50", "--eval_steps", "25", "--save_steps", "0", "--report_to", "none"]


def evaluations(run_dir: str) -> list[float]:
    """The held-out accuracies a run logged, in order (none if it has not started)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [row["eval/accuracy"] for row in rows if "eval/accuracy" in row]


def toy_digest(toy: str) -> str:
    """The sha256 of a toy's weights: which toy a run trained, whatever folder it sits in."""
    with open(os.path.join(toy, "model", "model.safetensors"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def run_one(toy: str, name: str, script: str, flags: list[str], seed: int, extra: list[str], expected: int) -> dict:
    """One run (or its finished metrics): {name, toy, toy_sha256, seed, gain}."""
    toy_name = os.path.basename(os.path.normpath(toy))
    workdir = os.path.join("runs", "learning_bars", toy_name)
    os.makedirs(os.path.join(workdir, "runs"), exist_ok=True)
    link = os.path.join(workdir, "runs", "toy")
    if not os.path.exists(link):
        os.symlink(os.path.abspath(toy), link)
    run_name = f"{name}__s{seed}"
    run_dir = os.path.join(workdir, "runs", run_name)
    accuracies = evaluations(run_dir)
    if len(accuracies) < expected:  # not run, or stopped before its last evaluation: run it anew
        subprocess.run(["rm", "-rf", run_dir], check=True)
        argv = [sys.executable, os.path.join(REPO, script), *COMMON, *flags, "--seed", str(seed),
                "--run_name", run_name, *extra]
        with open(os.path.join(toy, "toy.json")) as f:
            toy_seed = json.load(f)["seed"]  # the run must not take it for another seed's toy and rebuild it
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "TOY_SEED": str(toy_seed)}
        log = os.path.join(workdir, f"{run_name}.log")
        with open(log, "w") as out:
            done = subprocess.run(argv, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
        if done.returncode != 0:
            raise SystemExit(f"{shlex.join(argv)} failed (exit {done.returncode}): see {log}")
        accuracies = evaluations(run_dir)
    with open(os.path.join(toy, "toy.json")) as f:
        toy_seed = json.load(f)["seed"]
    gain = accuracies[-1] - accuracies[0]
    return {"name": name, "toy": f"seed{toy_seed}", "toy_sha256": toy_digest(toy), "seed": seed, "gain": gain}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algos", default=",".join(ALGORITHMS), help="comma-separated script names")
    p.add_argument("--toys", default="runs/toy", help="comma-separated toy folders")
    p.add_argument("--seeds", type=int, default=3, help="seeds 1..N")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time")
    p.add_argument("--extra", default="", help="flags added to every run (after the shared ones)")
    p.add_argument("--evaluations", type=int, default=3, help="evaluations a finished run has logged")
    p.add_argument("--out", default="runs/learning_bars/summary.json")
    p.add_argument("--merge", action="store_true",
                   help="keep --out's runs of the estimators not run now (and its commands), replace the others")
    a = p.parse_args(argv)
    jobs = []
    for toy in a.toys.split(","):
        for algo in a.algos.split(","):
            for name, flags in VARIANTS.get(algo, [(algo, [])]):
                for seed in range(1, a.seeds + 1):
                    jobs.append((toy, name, f"{algo}.py", flags, seed, shlex.split(a.extra), a.evaluations))
    with ThreadPoolExecutor(a.jobs) as pool:
        results = list(pool.map(lambda job: run_one(*job), jobs))
    command = shlex.join(["python", "benchmarks/learning_bars.py", *(argv or sys.argv[1:])])
    commands = [command]
    if a.merge and os.path.exists(a.out):
        with open(a.out) as f:
            kept = json.load(f)
        names = {r["name"] for r in results}
        results = [r for r in kept["runs"] if r["name"] not in names] + results
        commands = [*kept.get("commands", [kept["command"]]), command]
    summary = {}
    for name in dict.fromkeys(r["name"] for r in results):
        summary[name] = {}
        for toy in [None, *dict.fromkeys(r["toy"] for r in results)]:
            gains = [r["gain"] for r in results if r["name"] == name and toy in (None, r["toy"])]
            std = statistics.stdev(gains) if len(gains) > 1 else 0.0
            mean = statistics.mean(gains)
            summary[name][toy or "all"] = {"gains": gains, "mean": mean, "std": std}
            print(f"{name:12s} {toy or 'all':6s} gain {mean:+.3f} +- {std:.3f} over {len(gains)} runs")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"command": commands[0], "commands": commands, "runs": results, "summary": summary}, f,
                  indent=1)
    print(f"wrote {a.out}")
    return summary


if __name__ == "__main__":
    main()
