"""SNIB's self-normalised weights step by step, from a run's per-row dumps (snib.py
--dump_stats_steps 1 writes, for each optimizer step, every completion's log-weight u_i and its
group's log wbar_g, at the weights before that step).

    python -m evals.snib_weights runs/RUN [runs/OTHER ...]
    python -m evals.snib_weights docs/studies/TAG.json   # a study's SNIB runs, from their series

For each run and training step: the training reward; the clipped share the run logs
(policy/clip_frac: completions whose clip binds, w_i outside [1 - eps, 1 + eps] on the side of its
advantage's sign, over all completions); the share of self-normalised weights the clip changes,
whatever the advantage (outside [1 - eps, 1 + eps]: how the SNIB paper's Figure 2 counts "weights
unchanged"), over the step's optimizer steps and at its first and last; the group ESS
(1 / mean_g w^2, w averaging 1 over a group), its mean and least over the step's groups; the
spread of the raw log-weights u_i and of the self-normalised ones, log w_i; the KL to the reference
where there is one.
"""

import glob
import json
import os
import statistics
import sys

import torch


def group_ess(w: torch.Tensor, G: int) -> torch.Tensor:
    """(N,) each group's effective sample size over G, (mean w)^2 / mean w^2: 1 when every weight
    of the group is equal, 1 / G when one weight holds it all."""
    w = w.view(-1, G)  # (N, G)
    return w.mean(1) ** 2 / (w**2).mean(1)


def step_rows(run_dir: str, epsilon: float = 0.2, G: int = 8) -> list[dict]:
    """One row per training step with dumps, as the module's docstring lists."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        logged = {m["step"]: m for m in map(json.loads, f) if "reward/mean" in m}
    rows = []
    for path in sorted(glob.glob(os.path.join(run_dir, "stats", "step_*.rank0.pt"))):
        step = int(os.path.basename(path)[len("step_") : -len(".rank0.pt")])
        dumps = torch.load(path)  # one dict per optimizer step of this training step
        changed, ess, raw_std, log_w_std = [], [], [], []
        for d in dumps:
            log_w = d["log_weight"] - d["log_wbar"]  # (B,) log w_i, self-normalised
            w = log_w.exp()
            changed.append(((w - 1).abs() > epsilon).float().mean().item())
            ess.append(group_ess(w, G))
            raw_std.append(d["log_weight"].std(correction=0).item())
            log_w_std.append(log_w.std(correction=0).item())
        ess_all = torch.cat(ess)
        m = logged[step]
        rows.append(
            {
                "step": step,
                "reward": m["reward/mean"],
                "clip_logged": m["policy/clip_frac"],
                "changed": statistics.mean(changed),
                "changed_first": changed[0],
                "changed_last": changed[-1],
                "ess_mean": ess_all.mean().item(),
                "ess_min": ess_all.min().item(),
                "raw_std": statistics.mean(raw_std),
                "log_w_std": statistics.mean(log_w_std),
                "kl": m.get("policy/kl"),
            }
        )
    return rows


SERIES = ["reward/mean", "policy/clip_frac", "snib/ess", "snib/raw_logweight_std", "policy/kl"]


def study_rows(path: str) -> dict[int, list[dict]]:
    """seed -> one row per step of a study's SNIB run: the SERIES it logged (a study file keeps
    them, not the dumps)."""
    with open(path) as f:
        results = [r for r in json.load(f)["results"] if r["algo"] == "snib"]
    out = {}
    for r in results:
        by_step: dict[int, dict] = {}
        for name in SERIES:
            for step, value in r["series"].get(name, []):
                by_step.setdefault(step, {"step": step})[name] = value
        out[r["seed"]] = [by_step[k] for k in sorted(by_step)]
    return out


COLUMNS = [
    "step",
    "reward",
    "clip logged",
    "changed",
    "first",
    "last",
    "ESS mean",
    "ESS least",
    "u std",
    "log w std",
    "KL",
]


def main(run_dirs: list[str]) -> None:
    """A markdown table per run (or per seed of a study file)."""
    for path in [p for p in run_dirs if p.endswith(".json")]:
        for seed, rows in study_rows(path).items():
            print(f"{path}, seed {seed}:\n\n| step | {' | '.join(SERIES)} |")
            print(f"|{' --- |' * (len(SERIES) + 1)}")
            for r in rows:
                cells = [f"{r[k]:.3f}" if k in r else "-" for k in SERIES]
                print(f"| {r['step']} | {' | '.join(cells)} |")
            print()
    for run_dir in [p for p in run_dirs if not p.endswith(".json")]:
        print(f"{run_dir}:\n\n| {' | '.join(COLUMNS)} |\n|{' --- |' * len(COLUMNS)}")
        for r in step_rows(run_dir):
            kl = "-" if r["kl"] is None else f"{r['kl']:.4f}"
            keys = [
                "reward",
                "clip_logged",
                "changed",
                "changed_first",
                "changed_last",
                "ess_mean",
                "ess_min",
                "raw_std",
                "log_w_std",
            ]
            cells = [str(r["step"])] + [f"{r[k]:.3f}" for k in keys] + [kl]
            print(f"| {' | '.join(cells)} |")
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
