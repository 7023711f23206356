"""Run several estimators on the same task and seeds, then tabulate and plot held-out accuracy.

    python -m evals.compare --preset toy --seeds 3                # every estimator
    python -m evals.compare --algos grpo,snib --preset toy --seeds 3 --extra "--num_iterations 4" --tag mu4
    python -m evals.compare --preset toy --seeds 3 --vary rollout_lag=0,1,2,4 --tag lag
    python -m evals.compare --preset toy --seeds 3 --vary rollout_lag=0,1,2,4 --tag lag --resume   # go on with it

Each run is `python <algo>.py --preset ... --seed S` in its own process (`--jobs` at a time, `--threads`
torch threads each, default 1), written to runs/compare[-TAG]/<algo>__s<S> (with --vary: <algo>__<FLAG><V>__s<S>).
Writes summary.md (mean +- std over seeds of the warm-start and final held-out accuracy and of wall time),
summary.json, study.json (the command, its commit and every run's evaluations, training minutes and diagnostics:
copied to docs/studies/TAG.json, the source of the study's tables in the docs) and accuracy.png (against steps and
training minutes, and each seed's last evaluation); with --vary, the final accuracy by algorithm and value,
each seed's, and accuracy_vs_<FLAG>.png.

One evals.compare runs a study at a time (runs/compare-TAG/.compare.lock: a second stops at once; --jobs N runs N
in parallel). A study survives interruptions: each finished run writes its result beside its folder
(<run>.result.json), and --resume (with the study's own flags) reads those instead of running them again, resumes an
interrupted run from its last checkpoint (--resume_from; one with no checkpoint yet starts anew), and
runs the rest. A finished run keeps its metrics.jsonl and drops its checkpoints (the disk;
--keep_checkpoints keeps them). A resumed run's wall time is its last process's.
"""

import contextlib
import importlib
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from evals import ALGORITHMS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class CompareArgs:
    algos: str = field(default=",".join(ALGORITHMS), metadata={"help": "comma-separated script names (default: all)"})
    preset: str = field(default="toy", metadata={"help": "--preset passed to every run"})
    seeds: int = field(default=3, metadata={"help": "seeds 1..N per algorithm"})
    extra: str = field(default="", metadata={"help": "extra flags for every run, e.g. '--num_iterations 4'"})
    tag: str = field(default="", metadata={"help": "suffix of the output folder runs/compare-TAG"})
    jobs: int = field(default=2, metadata={"help": "runs at a time"})
    threads: int = field(default=1, metadata={"help": "torch threads of each run (jobs x threads: the cores it takes)"})
    vary: str = field(default="", metadata={"help": "FLAG=V1,V2,...: each run once per value, e.g. rollout_lag=0,1,2"})
    resume: bool = field(default=False, metadata={
        "help": "go on with a study: finished runs are read, interrupted ones resume from their last checkpoint"})
    keep_checkpoints: bool = field(default=False, metadata={
        "help": "keep a finished run's checkpoints (default: deleted, its metrics.jsonl kept)"})


ALGOS = ALGORITHMS  # every estimator script at the project root (evals/__init__.py)
RUNNING: set[subprocess.Popen] = set()  # the runs in progress, stopped when one of them fails


def varied(args: CompareArgs) -> tuple[str | None, list[str | None]]:
    """--vary FLAG=V1,V2: the flag and its values; (None, [None]) without it."""
    if not args.vary:
        return None, [None]
    flag, _, values = args.vary.partition("=")
    return flag.strip().removeprefix("--"), [v.strip() for v in values.split(",") if v.strip()]


def run_label(algo: str, seed: int, args: CompareArgs, value: str | None = None) -> str:
    flag, _ = varied(args)
    return f"{algo}__s{seed}" if flag is None else f"{algo}__{flag}{value}__s{seed}"


def run_argv(algo: str, seed: int, args: CompareArgs, out_dir: str, value: str | None = None) -> list[str]:
    run_name = os.path.join(os.path.basename(out_dir), run_label(algo, seed, args, value))
    flag, _ = varied(args)
    return ["--preset", args.preset, "--seed", str(seed), "--run_name", run_name, *shlex.split(args.extra),
            *([] if flag is None else [f"--{flag}", value])]


@contextlib.contextmanager
def claim_study(out_dir: str):
    """An exclusive lock on the study's folder while the study runs: a second evals.compare on the same --tag would
    take an unfinished run of the first for an interrupted one and start it anew, deleting its folder."""
    import fcntl

    handle = open(os.path.join(out_dir, ".compare.lock"), "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise SystemExit(f"error: {out_dir} is in use by another evals.compare ({holder}); wait for it to end, or "
                         f"pass another --tag (--jobs N runs N at a time in one study)")
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}")
    handle.flush()
    try:
        yield
    finally:
        handle.close()  # the lock goes with it


def check_compare_args(args: CompareArgs, out_dir: str) -> list[str]:
    """The algorithms, counts and extra flags, each script's own validation of its flags, and unused run folders:
    all before the first run starts (a typo must not surface minutes later, in a log file)."""
    from common.args import PRESET_NAMES, parse_args
    from common.rails.checks import argument_problems, resource_problems

    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    problems = [f"--algos: no script {a}.py; choose from {','.join(ALGOS)}" for a in algos if a not in ALGOS]
    problems += [f"--{name} {getattr(args, name)} must be at least 1" for name in ("seeds", "jobs", "threads")
                 if getattr(args, name) < 1]
    if args.preset not in PRESET_NAMES:
        problems.append(f"--preset {args.preset!r}: choose one of {sorted(PRESET_NAMES)}")
    try:
        shlex.split(args.extra)
    except ValueError as e:
        problems.append(f"--extra {args.extra!r}: {e}")
    if not algos:
        problems.append("--algos is empty; name at least one of " + ",".join(ALGOS))
    flag, values = varied(args)
    if args.vary and (not flag or not values or "=" not in args.vary):
        problems.append(f"--vary {args.vary!r}: write FLAG=V1,V2,... (e.g. rollout_lag=0,1,2,4)")
    if problems:
        raise SystemExit("\n".join(f"error: {p}" for p in problems))
    from common.tasks.data import PRESET_MODULES

    importlib.import_module(PRESET_MODULES[args.preset]).prepare_preset(args.preset)  # build the shared warm start
    # once, before parallel runs race to
    for algo in algos:
        for value in values:
            try:
                run_args = parse_args(importlib.import_module(algo).Args, run_argv(algo, 1, args, out_dir, value))
            except SystemExit as e:  # an unknown --vary flag or a value of the wrong type
                problems.append(f"{algo}: {e}")
                continue
            found = argument_problems(run_args, 1)
            problems += [f"{algo}: {p}" for p in found or resource_problems(run_args)[0]]
    runs = [os.path.join(out_dir, run_label(algo, seed, args, v)) for algo in algos for v in values
            for seed in range(1, args.seeds + 1)]
    used = [run for run in runs if os.path.isdir(run) and set(os.listdir(run)) - {".lock"}]
    if used and not args.resume:
        problems.append(f"{used[0]} holds a run already{f' (and {len(used) - 1} more)' if len(used) > 1 else ''}; "
                        f"pass another --tag, --resume to go on with it, or delete {out_dir}")
    if problems:
        raise SystemExit("\n".join(f"error: {p}" for p in problems))
    return algos


def run_one(algo: str, seed: int, args: CompareArgs, out_dir: str, value: str | None = None) -> dict:
    cmd = [sys.executable, os.path.join(REPO, f"{algo}.py"), *run_argv(algo, seed, args, out_dir, value)]
    run_name = os.path.join(os.path.basename(out_dir), run_label(algo, seed, args, value))
    run_dir = os.path.join("runs", run_name)
    result_path = run_dir + ".result.json"
    if args.resume:
        from common.run_folder.checkpoints import latest_checkpoint

        if os.path.exists(result_path):  # finished: read, not run again
            with open(result_path) as f:
                result = json.load(f)
            if "series" not in result and os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
                result.update(run_record(run_dir))  # a result written before run_record kept all it keeps now
                with open(result_path, "w") as f:
                    json.dump(result, f)
            return result
        if os.path.isdir(run_dir) and latest_checkpoint(run_dir):  # interrupted: from its last checkpoint
            cmd += ["--resume_from", run_dir]
        elif os.path.isdir(run_dir):  # interrupted before its first checkpoint: anew
            shutil.rmtree(run_dir)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    start = time.time()
    log_path = os.path.join("runs", run_name + ".log")
    with open(log_path, "w") as log:
        process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        RUNNING.add(process)
        code = process.wait()
        RUNNING.discard(process)
    if code:
        with open(log_path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
        cause = next((line for line in reversed(lines) if line.startswith("error:")), lines[-1] if lines else "")
        raise SystemExit(f"error: {algo} seed {seed} failed (exit {code}): {cause[:300]} (log: {log_path})")
    result = {"algo": algo, "seed": seed, "value": value, "seconds": time.time() - start, "commit": head_commit(),
              "machine": machine(), **run_record(run_dir)}
    if not args.keep_checkpoints:  # the disk: a real model's checkpoint with its optimizer is about 1 GB
        shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
    with open(result_path, "w") as f:  # last: a run with a result file is finished
        json.dump(result, f)
    return result


# How far each step's optimisation ran from the data's policy, and what it did to the policy: the mean over steps of
# each of these that a run logs (docs/metrics.md), kept in its result beside its evaluations.
DIAGNOSTICS = ("policy/ess", "policy/log_ratio_std", "policy/clip_frac", "policy/entropy", "policy/kl",
               "p3o/capped_frac", "covpo/selected_frac",  # P3O's clip (capped at the ESS); Clip-Cov's dropped tokens
               "p3o/ess", "snib/ess", "snib/raw_logweight_std", "reward/mean",  # claims (issue 53)
               # issue 67: the stale steps, and what a completion's length costs an evaluation
               "rollout/staleness", "completion/length_mean")


def run_record(run_dir: str) -> dict:
    """From a run's metrics.jsonl: its evaluations [(step, accuracy)], the training minutes before each (time/step
    summed over the steps up to it: the evaluations' own time left out), each evaluation's seconds
    (time/eval, where logged), the mean over steps of each DIAGNOSTICS metric it logs, and each
    one's series [(step, value)] (a claim about a trend needs the steps)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    evals = [(m["step"], m["eval/accuracy"]) for m in records if "eval/accuracy" in m]
    step_seconds = {m["step"]: m["time/step"] for m in records if "time/step" in m}
    minutes = [sum(t for k, t in step_seconds.items() if k <= step) / 60 for step, _ in evals]
    diagnostics, series = {}, {}
    for name in DIAGNOSTICS:
        steps = [(m["step"], m[name]) for m in records if name in m]
        if steps:
            diagnostics[name] = statistics.mean(value for _, value in steps)
            series[name] = steps
    eval_seconds = [m["time/eval"] for m in records if "eval/accuracy" in m and "time/eval" in m]
    return {"evals": evals, "minutes": minutes, "eval_seconds": eval_seconds,
            "diagnostics": diagnostics, "series": series}


def machine() -> str:
    """The CPU a run ran on and the instruction set torch's kernels dispatch to there, e.g. "AMD EPYC (family 25,
    model 17), torch AVX512". A run's floats depend on both (so does the toy's build: docs/toy.md), so the runs of a
    study match seed for seed only on one kind of machine; a study carried across machines names each."""
    import torch

    fields = {}
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's fields
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    name = fields.get("model name") or platform.processor() or platform.machine()
    where = f" (family {fields['cpu family']}, model {fields.get('model', '?')})" if "cpu family" in fields else ""
    return f"{name}{where}, torch {torch.backends.cpu.get_cpu_capability()}"


def head_commit() -> str:
    done = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def write_study(results: list[dict], flag: str | None, out_dir: str, command: str) -> None:
    """study.json: the command, the commit its runs ran at and every run's evaluations. Copied to
    docs/studies/TAG.json, it is the one source of the study's table in the docs (`<!-- begin: study TAG -->`,
    docs/make_diffs.py). Each run records its commit; a run recorded before that takes the commit of the study.json
    it was first written into, so a study finished (or completed by run_record) from a later checkout still names
    the code its runs ran; runs of several commits are named together, comma-separated, and the machines the runs
    ran on (machine(); a run recorded before it names none) are listed."""
    path = os.path.join(out_dir, "study.json")
    earlier = None
    if os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f).get("commit")
    if earlier is None and any("commit" not in r for r in results):
        earlier = head_commit()
    commits = [r.get("commit") or earlier for r in results]
    machines = list(dict.fromkeys(r["machine"] for r in results if "machine" in r))  # none for runs before machine()
    study = {"command": command, "commit": ",".join(dict.fromkeys(commits)), "machines": machines, "vary": flag,
             "results": results}
    with open(path, "w") as f:
        json.dump(study, f, indent=1)


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


def summarize_vary(results: list[dict], algos: list[str], flag: str, values: list[str], out_dir: str,
                   command: str) -> str:
    """Final held-out accuracy by algorithm (rows) and value of the varied flag (columns): mean +- std over seeds,
    then every seed's, so a reader sees where seeds disagree."""
    final = lambda algo, v: [r["evals"][-1][1] for r in results if r["algo"] == algo and r["value"] == v]  # noqa: E731
    head = f"| algorithm | {' | '.join(f'{flag} {v}' for v in values)} |"
    lines = [f"`{command}`", "", "Final held-out accuracy, mean +- std over seeds:", "", head,
             "|" + " --- |" * (len(values) + 1)]
    lines += [f"| {algo} | {' | '.join(mean_std(final(algo, v)) for v in values)} |" for algo in algos]
    lines += ["", "Each seed's (seeds 1, 2, ...):", "", head, "|" + " --- |" * (len(values) + 1)]
    lines += [f"| {algo} | {' | '.join(' / '.join(f'{a:.3f}' for a in final(algo, v)) for v in values)} |"
              for algo in algos]
    warm = [r["evals"][0][1] for r in results]
    lines += ["", f"Warm start (step 0): {mean_std(warm)} over all runs."]
    table = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(table)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(results, f, indent=1)
    return table


def plot_vary(results: list[dict], algos: list[str], flag: str, values: list[str], out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6 if len(algos) <= 8 else 9, 4))
    colors = plt.get_cmap("tab20" if len(algos) > 10 else "tab10")
    xs = [float(v) for v in values]
    spread = 0.32 / max(len(algos) - 1, 1)  # the estimators side by side within a third of a step, seeds visible
    for i, algo in enumerate(algos):
        finals = [[r["evals"][-1][1] for r in results if r["algo"] == algo and r["value"] == v] for v in values]
        offset = (i - (len(algos) - 1) / 2) * spread * (max(xs) - min(xs) or 1) / max(len(xs) - 1, 1)
        ax.plot([x + offset for x in xs], [statistics.mean(f) for f in finals], "-o", color=colors(i), label=algo,
                markersize=3 if len(algos) > 8 else 6)
        for x, f in zip(xs, finals):
            ax.scatter([x + offset] * len(f), f, color=colors(i), alpha=0.35, s=12)
    ax.set_xlabel(flag)
    ax.set_xticks(xs)
    ax.set_ylabel("final held-out greedy accuracy")
    ax.legend(fontsize=7, ncol=2 if len(algos) > 8 else 1)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"accuracy_vs_{flag}.png"), dpi=120)


def plot(results: list[dict], algos: list[str], out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = int(all("minutes" in r for r in results))  # 1: a panel against the training minutes
    seeded = int(any(sum(r["algo"] == algo for r in results) > 1 for algo in algos))  # 1: a panel of each seed
    panels = 1 + timed + seeded
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    colors = plt.get_cmap("tab20" if len(algos) > 10 else "tab10")
    for i, algo in enumerate(algos):
        rs = [r for r in results if r["algo"] == algo]
        steps = [s for s, _ in rs[0]["evals"]]
        mean = [statistics.mean(r["evals"][k][1] for r in rs) for k in range(len(steps))]
        axes[0, 0].plot(steps, mean, label=algo, color=colors(i))
        for r in rs:
            axes[0, 0].plot(steps, [a for _, a in r["evals"]], color=colors(i), alpha=0.2, linewidth=0.8)
        if timed:  # against the training minutes (each run's own clock, its evaluations left out)
            minutes = [statistics.mean(r["minutes"][k] for r in rs) for k in range(len(steps))]
            axes[0, 1].plot(minutes, mean, label=algo, color=colors(i))
        if seeded:  # each seed's last evaluation, and their mean: the spread the study's p-values are about
            finals = [r["evals"][-1][1] for r in rs]
            axes[0, -1].scatter([i] * len(finals), finals, color=colors(i), s=14, alpha=0.7)
            axes[0, -1].plot([i - 0.3, i + 0.3], [statistics.mean(finals)] * 2, color=colors(i), linewidth=2)
    axes[0, 0].set_xlabel("RL step")
    if timed:
        axes[0, 1].set_xlabel("training minutes (mean over seeds)")
    for ax in axes[0][:1 + timed]:
        ax.set_ylabel("held-out greedy accuracy (mean over seeds)")
        ax.grid(alpha=0.3)
    axes[0, timed].legend(fontsize=7, ncol=2 if len(algos) > 8 else 1)
    if seeded:
        last = max(s for r in results for s, _ in r["evals"][-1:])
        axes[0, -1].set_xticks(range(len(algos)), algos, rotation=60, fontsize=7)
        axes[0, -1].set_ylabel(f"held out at step {last}: each seed, the mean")
        axes[0, -1].grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "accuracy.png"), dpi=120)


def main(args: CompareArgs) -> str:
    out_dir = os.path.join("runs", "compare" + (f"-{args.tag}" if args.tag else ""))
    algos = check_compare_args(args, out_dir)
    os.makedirs(out_dir, exist_ok=True)
    with claim_study(out_dir):  # no second evals.compare on this study while it runs
        flag, values = varied(args)
        jobs = [(algo, seed, value) for seed in range(1, args.seeds + 1) for value in values for algo in algos]
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = [pool.submit(run_one, algo, seed, args, out_dir, value) for algo, seed, value in jobs]
            try:
                results = [future.result() for future in futures]
            except SystemExit:  # one run failed: the others would be compared against nothing
                for future in futures:
                    future.cancel()
                for process in list(RUNNING):
                    process.terminate()
                raise
        command = "python -m evals.compare " + " ".join(shlex.quote(a) for a in sys.argv[1:])
        write_study(results, flag, out_dir, command)
        if flag is not None:
            table = summarize_vary(results, algos, flag, values, out_dir, command)
            plot_vary(results, algos, flag, values, out_dir)
            return (f"{table}\nwrote {out_dir}/summary.md, summary.json, accuracy_vs_{flag}.png "
                    f"(runs and logs: {out_dir}/)\n")
        table = summarize(results, algos, out_dir, command)
        plot(results, algos, out_dir)
        return (f"{table}\nwrote {out_dir}/summary.md, summary.json, accuracy.png (runs and logs: {out_dir}/)\n"
                f"learning curves of every run: python -m evals.plot {out_dir}/*__s*/ --out {out_dir}/plots")


if __name__ == "__main__":
    parsed, unknown = HfArgumentParser(CompareArgs).parse_args_into_dataclasses(return_remaining_strings=True)
    if unknown:
        raise SystemExit(f"error: unknown arguments {' '.join(unknown)}; flags for the runs go in --extra")
    print(main(parsed))
