"""Run several estimators on the same task and seeds, then tabulate and plot held-out accuracy.

    python -m evals.compare --algos grpo,gspo,snib,ctpo,p3o --preset toy --seeds 3
    python -m evals.compare --algos grpo,snib --preset toy --seeds 3 --extra "--num_iterations 4" --tag mu4

Each run is `python <algo>.py --preset ... --seed S` in its own process (`--jobs` at a time, one
thread each), written to runs/compare[-TAG]/<algo>__s<S>. Writes summary.md (mean +- std over seeds
of the warm-start and final held-out accuracy and of wall time), summary.json and accuracy.png.
"""

import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from transformers import HfArgumentParser

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class CompareArgs:
    algos: str = field(default="grpo,gspo,snib,ctpo,p3o", metadata={"help": "comma-separated script names"})
    preset: str = field(default="toy", metadata={"help": "--preset passed to every run"})
    seeds: int = field(default=3, metadata={"help": "seeds 1..N per algorithm"})
    extra: str = field(default="", metadata={"help": "extra flags for every run, e.g. '--num_iterations 4'"})
    tag: str = field(default="", metadata={"help": "suffix of the output folder runs/compare-TAG"})
    jobs: int = field(default=2, metadata={"help": "runs at a time (each gets one CPU thread)"})


def run_one(algo: str, seed: int, args: CompareArgs, out_dir: str) -> dict:
    run_name = os.path.join(os.path.basename(out_dir), f"{algo}__s{seed}")
    cmd = [sys.executable, os.path.join(REPO, f"{algo}.py"), "--preset", args.preset, "--seed", str(seed),
           "--run_name", run_name, *shlex.split(args.extra)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.time()
    with open(os.path.join(out_dir, f"{algo}__s{seed}.log"), "w") as log:
        subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT)
    with open(os.path.join("runs", run_name, "metrics.jsonl")) as f:
        evals = [(m["step"], m["eval/accuracy"]) for m in map(json.loads, f) if "eval/accuracy" in m]
    return {"algo": algo, "seed": seed, "seconds": time.time() - start, "evals": evals}


def mean_std(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} +- {statistics.stdev(values) if len(values) > 1 else 0.0:.3f}"


def summarize(results: list[dict], algos: list[str], out_dir: str, command: str) -> str:
    lines = [f"`{command}`", "", "| algorithm | warm start | final held-out accuracy | wall time (s) |",
             "| --- | --- | --- | --- |"]
    for algo in algos:
        rs = [r for r in results if r["algo"] == algo]
        lines.append(f"| {algo} | {mean_std([r['evals'][0][1] for r in rs])} | "
                     f"{mean_std([r['evals'][-1][1] for r in rs])} | {mean_std([r['seconds'] for r in rs])} |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(table)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(results, f, indent=1)
    return table


def plot(results: list[dict], algos: list[str], out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, algo in enumerate(algos):
        rs = [r for r in results if r["algo"] == algo]
        steps = [s for s, _ in rs[0]["evals"]]
        mean = [statistics.mean(r["evals"][k][1] for r in rs) for k in range(len(steps))]
        ax.plot(steps, mean, label=algo, color=f"C{i}")
        for r in rs:
            ax.plot(steps, [a for _, a in r["evals"]], color=f"C{i}", alpha=0.2, linewidth=0.8)
    ax.set_xlabel("RL step")
    ax.set_ylabel("held-out greedy accuracy")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "accuracy.png"), dpi=120)


def main(args: CompareArgs) -> str:
    algos = args.algos.split(",")
    out_dir = os.path.join("runs", "compare" + (f"-{args.tag}" if args.tag else ""))
    os.makedirs(out_dir, exist_ok=True)
    if args.preset == "toy":  # build the shared warm start once, before parallel runs race to
        from common.toy import TOY_DIR, prepare_toy

        prepare_toy(TOY_DIR)
    jobs = [(algo, seed) for seed in range(1, args.seeds + 1) for algo in algos]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda job: run_one(*job, args, out_dir), jobs))
    command = "python -m evals.compare " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    table = summarize(results, algos, out_dir, command)
    plot(results, algos, out_dir)
    return (f"{table}\nwrote {out_dir}/summary.md, summary.json, accuracy.png (runs and logs: {out_dir}/)\n"
            f"learning curves of every run: python -m evals.plot {out_dir}/*__s*/ --out {out_dir}/plots")


if __name__ == "__main__":
    (parsed,) = HfArgumentParser(CompareArgs).parse_args_into_dataclasses()
    print(main(parsed))
