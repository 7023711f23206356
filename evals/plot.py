"""Figures from training runs: learning curves overlaid across runs, and the papers' diagnostic figures.

    python -m evals.plot RUN_DIR [RUN_DIR ...] [--out DIR]

Reads each run's metrics.jsonl, args.json (the run's Args) and stats/ (written with --dump_stats_steps), and
writes each figure the runs have data for (a sweep figure needs runs that differ in the swept flag):

    learning_curves.png                      reward, held-out accuracy, entropy, length, KL, clip fraction
    ctpo_fig1_position.png                   CTPO Figure 1: std of c_t and clip rate by position, adaptive vs fixed
                                             clip (the ratio window [0.5, 5] on the same run's ratios, as the authors)
    snib_fig2_logweights.png                 SNIB Figure 2: histograms of raw u_i and self-normalised u_i - log wbar_g
    snib_fig1a_reward_noise.png              SNIB Figure 1a: final reward against --reward_noise sigma
    snib_fig1b_reward_kl.png                 SNIB Figure 1b: final reward against final KL over a --beta sweep
    landscape_fig9_fig10_length_entropy.png  landscape paper Figures 9, 10: GRPO, PL, NL, CL, TNCL runs of landscape.py

Every figure is a function of a list of `Run`s that returns the path it wrote, or None without the data.
"""

import glob
import json
import math
import os
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch
from matplotlib.figure import Figure
from transformers import HfArgumentParser

CURVES = [("reward/mean", "reward (train)"), ("eval/accuracy", "held-out accuracy"),
          ("policy/entropy", "entropy (nats / token)"), ("completion/length_mean", "completion length (tokens)"),
          ("policy/kl", "KL to reference (k3)"), ("policy/clip_frac", "clip fraction")]
# The ratio window whose clip rate ctpo.py logs as fixed_clip_frac (its FIG1_FIXED_WINDOW; evals/ imports no script,
# tests/test_plot.py holds the two equal)
FIXED_WINDOW = (0.5, 5.0)
BUCKET = re.compile(r"pos_(\d+)(?:-(\d+)|\+)")  # ctpo.py's POSITION_BUCKETS names: pos_1-16, ..., pos_1025+
DUMP = re.compile(r"step_(\d+)\.rank(\d+)\.pt")


@dataclass
class PlotArgs:
    out: str | None = field(default=None, metadata={"help": "output folder (default: RUN_DIR/plots for one run, "
                                                              "runs/plots for several)"})
    smooth: int = field(default=1, metadata={"help": "learning curves: trailing mean over this many logged steps"})
    last: int = field(default=10, metadata={"help": "a run's final value is its mean over the last N logged steps"})
    ctpo_steps: str = field(default="", metadata={"help": "CTPO Figure 1: comma-separated steps, one column each "
                                                          "(default: a third, two thirds and the end of the run)"})
    stats_step: int = field(default=0, metadata={"help": "SNIB Figure 2: the dumped step (default: the last one)"})


@dataclass
class Run:
    name: str
    dir: str
    metrics: list[dict]
    args: dict

    def series(self, key: str) -> tuple[list[int], list[float]]:
        rows = [m for m in self.metrics if key in m]
        return [m["step"] for m in rows], [m[key] for m in rows]

    def final(self, key: str, last: int) -> float | None:
        values = self.series(key)[1][-last:]
        return statistics.mean(values) if values else None


def load_run(run_dir: str) -> Run:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"error: {run_dir!r} has no metrics.jsonl: pass run folders written by the training "
                         f"scripts (output_dir/run_name, e.g. runs/snib__1__1700000000)")
    metrics = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                metrics.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: {path} line {number} is not JSON ({e.msg}); a run killed while writing "
                                 f"leaves a cut last line: delete that line") from None
    if not metrics:
        raise SystemExit(f"error: {path} is empty: the run has logged no step yet (nothing to plot)")
    if not all(isinstance(m, dict) and "step" in m for m in metrics):
        raise SystemExit(f"error: {path} holds lines without a 'step': not a training run's metrics.jsonl")
    args = {}
    if os.path.isfile(os.path.join(run_dir, "args.json")):
        try:
            with open(os.path.join(run_dir, "args.json")) as f:
                args = json.load(f)
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: {os.path.join(run_dir, 'args.json')} is not JSON ({e.msg})") from None
    return Run(os.path.basename(os.path.normpath(run_dir)), run_dir, metrics, args)


def new_figure(rows: int, cols: int, width: float = 4.5, height: float = 3.3):
    fig = Figure(figsize=(width * cols, height * rows))  # no pyplot: no global state, no display backend
    return fig, fig.subplots(rows, cols, squeeze=False)


def save(fig: Figure, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def trailing_mean(values: list[float], n: int) -> list[float]:
    return [statistics.mean(values[max(0, i - n + 1): i + 1]) for i in range(len(values))]


# Learning curves
def curve_panels(runs: list[Run]) -> list[tuple[str, str]]:
    """The (key, label) panels to draw: those at least one run logged."""
    return [(key, label) for key, label in CURVES if any(run.series(key)[0] for run in runs)]


def plot_learning_curves(runs: list[Run], path: str, smooth: int = 1) -> str | None:
    panels = curve_panels(runs)
    if not panels:
        return None
    cols = min(3, len(panels))
    fig, axes = new_figure(math.ceil(len(panels) / cols), cols)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (key, label) in zip(axes.flat, panels):
        for i, run in enumerate(runs):
            steps, values = run.series(key)
            marker = "o" if len(steps) <= 30 else None  # sparse series (evaluations) get markers
            ax.plot(steps, trailing_mean(values, smooth), marker=marker, markersize=3, color=f"C{i}", label=run.name)
        ax.set(xlabel="RL step", ylabel=label)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    return save(fig, path)


# CTPO Figure 1
def position_buckets(runs: list[Run]) -> list[tuple[str, float]]:
    """The position buckets the runs logged, in order, with a representative position (geometric middle;
    the open last bucket is drawn at twice its start)."""
    names = {key.rsplit("/", 1)[1] for run in runs for m in run.metrics for key in m
             if key.startswith("ctpo/clip_frac/")}
    buckets = []
    for name in names:
        lo, hi = BUCKET.fullmatch(name).groups()
        buckets.append((int(lo), name, math.sqrt(int(lo) * (int(hi) if hi else 2 * int(lo)))))
    return [(name, middle) for _, name, middle in sorted(buckets)]


def clip_label(run: Run) -> str:
    power = run.args.get("clip_power")
    if power is None:
        return run.name
    return f"{run.name}: " + ("fixed log-space bounds (clip_power 0)" if power == 0 else f"adaptive clip (p^{power:g})")


def clip_rate_lines(run: Run, row: dict, buckets: list[tuple[str, float]]) -> list[tuple[str, list[tuple]]]:
    """CTPO Figure 1's bottom row for one run: (label, points) of the clip rate it trained with and, as the paper's
    "fixed clip" curve, the rate the ratio window [0.5, 5] has on the same ratios (logged by ctpo.py)."""
    lines = [(clip_label(run), bucket_points(row, "clip_frac", buckets))]
    fixed = bucket_points(row, "fixed_clip_frac", buckets)
    if fixed:
        lines.append((f"{run.name}: fixed clip, ratio in [{FIXED_WINDOW[0]:g}, {FIXED_WINDOW[1]:g}]", fixed))
    return lines


def nearest_row(run: Run, step: int, key_prefix: str) -> dict | None:
    rows = [m for m in run.metrics if any(k.startswith(key_prefix) for k in m)]
    return min(rows, key=lambda m: abs(m["step"] - step)) if rows else None


def bucket_points(row: dict, metric: str, buckets: list[tuple[str, float]]) -> list[tuple[float, float]]:
    return [(p, row[f"ctpo/{metric}/{name}"]) for name, p in buckets if f"ctpo/{metric}/{name}" in row]


def plot_ctpo_fig1(runs: list[Run], path: str, steps: list[int] | None = None) -> str | None:
    """Top: std of the cumulative log-ratio c_t per position bucket, with a least-squares fit a * sqrt(p);
    bottom: fraction of tokens clipped per bucket, by the run's own clip (solid) and by the fixed window on the
    same ratios (dashed). One column per step, one colour per run."""
    buckets = position_buckets(runs)
    if not buckets:
        return None
    runs = [run for run in runs if nearest_row(run, 0, "ctpo/") is not None]
    if not steps:
        logged = sorted({m["step"] for run in runs for m in run.metrics if any(k.startswith("ctpo/") for k in m)})
        steps = sorted({logged[max(0, math.ceil(len(logged) * f) - 1)] for f in (1 / 3, 2 / 3, 1)})
    grid = np.geomspace(buckets[0][1], buckets[-1][1], 50)
    fig, axes = new_figure(2, len(steps))
    for col, step in enumerate(steps):
        for i, run in enumerate(runs):
            row = nearest_row(run, step, "ctpo/")
            std = bucket_points(row, "cum_logratio_std", buckets)
            axes[0, col].plot(*zip(*std), marker="o", color=f"C{i}", label=clip_label(run))
            for style, (label, points) in zip(("-", "--"), clip_rate_lines(run, row, buckets)):
                axes[1, col].plot(*zip(*points), marker="o", linestyle=style, color=f"C{i}", label=label)
            a = sum(y * math.sqrt(p) for p, y in std) / sum(p for p, _ in std)  # argmin_a sum (y - a sqrt(p))^2
            axes[0, col].plot(grid, a * np.sqrt(grid), linestyle="--", color=f"C{i}", alpha=0.6,
                              label="fit a * sqrt(p)" if i == 0 else None)
        axes[0, col].set(title=f"step {step}", ylabel="std of cumulative log-ratio c_t")
        axes[1, col].set(ylabel="clip rate")
        for ax in axes[:, col]:
            ax.set(xscale="log", xlabel="token position p")
            ax.set_xticks([p for _, p in buckets], [name[len("pos_"):] for name, _ in buckets], fontsize="small")
            ax.minorticks_off()
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize="small")
    axes[1, 0].legend(fontsize="small")
    return save(fig, path)


# SNIB Figure 2
def load_weight_dumps(run: Run, step: int = 0) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """(step, raw u_i, self-normalised u_i - log wbar_g) over all processes and optimizer steps of one dumped
    RL step (default: the last), or None when the run dumped no SNIB weights."""
    files = defaultdict(list)
    for path in glob.glob(os.path.join(run.dir, "stats", "step_*.rank*.pt")):
        match = DUMP.fullmatch(os.path.basename(path))
        if match:
            files[int(match.group(1))].append(path)
    if not files:
        return None
    if step and step not in files:
        raise SystemExit(f"error: {run.dir}/stats has no dump of step {step}; dumped steps: {sorted(files)}")
    step = step or max(files)
    dumps = [d for path in sorted(files[step]) for d in torch.load(path) if "log_weight" in d and "log_wbar" in d]
    if not dumps:
        return None
    u = torch.cat([d["log_weight"] for d in dumps]).float()  # (rows,)
    return step, u, u - torch.cat([d["log_wbar"] for d in dumps]).float()  # (rows,)  log w_i = u_i - log wbar_g


def plot_snib_fig2(runs: list[Run], path: str, step: int = 0) -> str | None:
    dumped = [(run, d) for run in runs if (d := load_weight_dumps(run, step)) is not None]
    if not dumped:
        return None
    fig, axes = new_figure(1, len(dumped), width=5.5, height=3.8)
    for ax, (run, (dump_step, raw, normalised)) in zip(axes[0], dumped):
        lo, hi = min(raw.min(), normalised.min()).item(), max(raw.max(), normalised.max()).item()
        if hi - lo < 1e-6:  # on-policy: every log-weight is 0
            lo, hi = lo - 0.5, hi + 0.5
        bins = np.linspace(lo, hi, 60)
        ax.hist(raw.numpy(), bins=bins, alpha=0.55, color="C3", label=f"raw u_i (Vanilla IS), std {raw.std():.3g}")
        ax.hist(normalised.numpy(), bins=bins, alpha=0.55, color="C0",
                label=f"self-normalised (SNIB), std {normalised.std():.3g}")
        eps = run.args.get("epsilon", 0.2)
        inside = ((normalised.exp() >= 1 - eps) & (normalised.exp() <= 1 + eps)).float().mean().item()
        ax.set(title=f"{run.name}, step {dump_step}: {len(raw)} completions\n"
                     f"{100 * inside:.1f}% of w_i inside the clip [1-eps, 1+eps], eps={eps:g}",
               xlabel="log importance weight", ylabel="completions")
        ax.legend(fontsize="small", loc="upper right")
        ax.grid(alpha=0.3)
    return save(fig, path)


# SNIB Figures 1a and 1b: sweeps, one point per run, one line per (algorithm, fixed flag)
def sweep_lines(runs: list[Run], swept: str, fixed: str, x_key: str | None, last: int) -> dict[str, list[tuple]]:
    """{line label: [(swept value, x, final reward), ...]} sorted by the swept value, for runs whose args.json
    has `swept` and that logged reward/mean (and `x_key` when given; else x is the swept value)."""
    lines = defaultdict(list)
    for run in runs:
        value, reward = run.args.get(swept), run.final("reward/mean", last)
        x = run.final(x_key, last) if x_key else value
        if value is None or reward is None or x is None:
            continue
        fixed_value = run.args.get(fixed) or 0
        label = run.args.get("exp_name", run.name) + (f" ({fixed}={fixed_value:g})" if fixed_value else "")
        lines[label].append((value, x, reward))
    return {label: sorted(points) for label, points in sorted(lines.items())}


def plot_sweep(lines: dict[str, list[tuple]], path: str, xlabel: str, annotate: str | None) -> str | None:
    if len({value for points in lines.values() for value, _, _ in points}) < 2:
        return None  # not a sweep
    fig, axes = new_figure(1, 1, width=5.5, height=4)
    ax = axes[0, 0]
    for i, (label, points) in enumerate(lines.items()):
        _, xs, rewards = zip(*points)
        ax.plot(xs, rewards, marker="o", color=f"C{i}", label=label)
        if annotate:
            for value, x, reward in points:
                ax.annotate(f"{annotate}={value:g}", (x, reward), textcoords="offset points", xytext=(4, 4),
                            fontsize="x-small", color=f"C{i}")
    ax.set(xlabel=xlabel, ylabel="final reward (train)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return save(fig, path)


def plot_snib_fig1a(runs: list[Run], path: str, last: int = 10) -> str | None:
    return plot_sweep(sweep_lines(runs, "reward_noise", "beta", None, last), path, "reward noise sigma", None)


def plot_snib_fig1b(runs: list[Run], path: str, last: int = 10) -> str | None:
    lines = sweep_lines(runs, "beta", "reward_noise", "policy/kl", last)
    return plot_sweep(lines, path, "final KL to reference (k3, per token)", "beta")


# Seed 003 Figures 9 and 10
def landscape_variant(args: dict) -> str:
    """The seed-003 name of a grpo.py run from its switches: GRPO, PL, NL, CL, TNCL, ... (+ off-policy)."""
    advantage, train_on = args.get("advantage"), args.get("train_on")
    names = {("zscore", "all"): "GRPO", ("sign", "positive"): "PL", ("sign", "negative"): "NL", ("sign", "all"): "CL"}
    name = names.get((advantage, train_on), f"{advantage} advantage, train_on {train_on}")
    if args.get("loss_agg") == "token-sum-norm":
        name = "TNCL" if name == "CL" else f"{name} (token norm)"
    if args.get("num_iterations", 1) > 1 or args.get("mini_batch_size", 0) not in (0, args.get("batch_size")):
        name += ", off-policy"
    return name


def plot_landscape(runs: list[Run], path: str, smooth: int = 1) -> str | None:
    runs = [run for run in runs if "train_on" in run.args]
    variants = [landscape_variant(run.args) for run in runs]
    if len(set(variants)) < 2:
        return None
    colors = {v: f"C{i}" for i, v in enumerate(dict.fromkeys(variants))}
    panels = [("reward/mean", "train accuracy (Figures 2-5)"), ("completion/length_mean", "length (Figure 9)"),
              ("policy/entropy", "entropy (Figure 10)")]
    fig, axes = new_figure(1, 3)
    for ax, (key, title) in zip(axes[0], panels):
        for run, variant in zip(runs, variants):
            steps, values = run.series(key)
            label = variant if variants.count(variant) == 1 else f"{variant}: {run.name}"
            ax.plot(steps, trailing_mean(values, smooth), color=colors[variant], label=label)
        ax.set(title=title, xlabel="RL step", ylabel=dict(CURVES)[key])
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize="small")
    return save(fig, path)


def main(run_dirs: list[str], args: PlotArgs) -> list[str]:
    """Every figure the runs have data for; a one-line error when the arguments or the runs allow none."""
    problems = [f"--{name} {getattr(args, name)} must be at least {least}"
                for name, least in (("smooth", 1), ("last", 1), ("stats_step", 0)) if getattr(args, name) < least]
    if not all(s.strip().isdigit() for s in args.ctpo_steps.split(",") if s.strip()):
        problems.append(f"--ctpo_steps {args.ctpo_steps!r} must be comma-separated step numbers, e.g. 100,200")
    if problems:
        raise SystemExit("\n".join(f"error: {p}" for p in problems))
    runs = [load_run(d) for d in run_dirs]
    out = args.out or (os.path.join(run_dirs[0], "plots") if len(run_dirs) == 1 else os.path.join("runs", "plots"))
    ctpo_steps = [int(s) for s in args.ctpo_steps.split(",") if s.strip()]
    figures = {
        "learning_curves.png": lambda path: plot_learning_curves(runs, path, args.smooth),
        "ctpo_fig1_position.png": lambda path: plot_ctpo_fig1(runs, path, ctpo_steps),
        "snib_fig2_logweights.png": lambda path: plot_snib_fig2(runs, path, args.stats_step),
        "snib_fig1a_reward_noise.png": lambda path: plot_snib_fig1a(runs, path, args.last),
        "snib_fig1b_reward_kl.png": lambda path: plot_snib_fig1b(runs, path, args.last),
        "landscape_fig9_fig10_length_entropy.png": lambda path: plot_landscape(runs, path, args.smooth),
    }
    written = [path for name, draw in figures.items() if (path := draw(os.path.join(out, name)))]
    if not written:
        raise SystemExit(f"error: no figure drawn: the runs logged none of {', '.join(k for k, _ in CURVES)} (nor "
                         f"the papers' diagnostics); pass run folders of the training scripts")
    return written


def parse_cli(argv: list[str] | None = None) -> tuple[list[str], PlotArgs]:
    parser = HfArgumentParser(PlotArgs)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders, each holding metrics.jsonl")
    args, positional, unknown = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    if unknown:
        raise SystemExit(f"error: unknown arguments {' '.join(unknown)}; --help lists the flags")
    return positional.run_dirs, args


if __name__ == "__main__":
    for written in main(*parse_cli()):
        print(written)
