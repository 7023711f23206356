"""Held-out accuracy of grpo.py runs beside TRL's (benchmarks/trl_curve.py reports), against RL steps and against
training wall time (evaluations left out of both), one thin line per seed and the mean of the seeds in bold.

    python benchmarks/trl_curve_plot.py --grpo runs/compare-smollm2/grpo__s1 runs/compare-smollm2/grpo__s2 \\
        --trl runs/benchmarks/trl_curve_smollm2_s1.json runs/benchmarks/trl_curve_smollm2_s2.json \\
        --out docs/real_model_grpo_trl.png

A grpo.py run folder gives its `eval/accuracy` lines and the sum of `time/step` up to each (metrics.jsonl); a TRL
report gives its curve's `accuracy` and `wall_s`. Prints the per-step mean and standard deviation of each side.
"""

import argparse
import json
import os
import statistics


def grpo_curve(run_dir: str) -> list[dict]:
    """[{step, accuracy, wall_s}] of one grpo.py run: wall_s is the training time before that evaluation."""
    curve, wall = [], 0.0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            wall += m.get("time/step", 0.0)
            if "eval/accuracy" in m:
                curve.append({"step": m["step"], "accuracy": m["eval/accuracy"], "wall_s": round(wall, 1)})
    return curve


def trl_curve(report: str) -> list[dict]:
    with open(report) as f:
        return json.load(f)["curve"]


def mean_by_step(curves: list[list[dict]]) -> dict[int, tuple[float, float]]:
    """{step: (mean accuracy, standard deviation over the seeds; 0 for one seed)} at the steps every curve has."""
    steps = sorted(set.intersection(*({p["step"] for p in c} for c in curves)))
    out = {}
    for step in steps:
        values = [next(p["accuracy"] for p in c if p["step"] == step) for c in curves]
        out[step] = (statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grpo", nargs="+", required=True, help="grpo.py run folders, one per seed")
    parser.add_argument("--trl", nargs="+", required=True, help="benchmarks/trl_curve.py reports, one per seed")
    parser.add_argument("--out", default="runs/benchmarks/trl_curve.png", help="figure (PNG)")
    a = parser.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = {"grpo.py": [grpo_curve(d) for d in a.grpo], "TRL GRPOTrainer": [trl_curve(r) for r in a.trl]}
    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(10, 3.8))
    for (label, curves), color in zip(sides.items(), ("tab:blue", "tab:orange")):
        for c in curves:
            by_step.plot([p["step"] for p in c], [100 * p["accuracy"] for p in c], color=color, alpha=0.3, lw=1)
            by_time.plot([p["wall_s"] / 60 for p in c], [100 * p["accuracy"] for p in c], color=color, alpha=0.5,
                         lw=1, marker="o", ms=3)
        means = mean_by_step(curves)
        by_step.plot(list(means), [100 * m for m, _ in means.values()], color=color, lw=2.5,
                     label=f"{label} (mean of {len(curves)})")
        print(label + ": " + ", ".join(f"step {s} {100 * m:.1f} +- {100 * sd:.1f}%" for s, (m, sd) in means.items()))
    by_step.set(xlabel="RL step", ylabel="held-out accuracy (%)", title="per step")
    by_time.set(xlabel="training wall time (min), evaluations left out", title="per minute (one line per seed)")
    by_step.legend()
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
