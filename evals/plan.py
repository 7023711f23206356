"""Issue 67's study, planned before its runs (docs/study-plan.md): its arms, its statistics, its
claims with the region each claim puts its effect in, the seeds they need, and the verdicts.

    python -m evals.plan                  # the seeds and the budget, from the pilot's runs
    python -m evals.plan --verdicts DIR   # each claim's effect, interval, p, Holm's p, verdict
                                          # (DIR: docs/studies, or runs/ while it runs); only the
                                          # seeds that every arm finished count

One rule for every claim (evals/stats.py verdict): the paired t interval of the claim's effect
over seeds against the claim's region, decided by its p (claim_p) adjusted by Holm over the whole
family of claims.
"""

import argparse
import glob
import json
import math
import os
import statistics
from dataclasses import dataclass

from evals.stats import claim_p, holm, paired_t, seeds_needed, t_quantile, verdict

# The regime every off-policy arm shares (the pilot's, docs/real-model.md), and the study's
# evaluations: the first 300 held-out sums of the larger set (the pilot's 200, then 100 more) at
# steps 8 and 10.
OFF_POLICY = "--temperature 0.7 --mini_batch_size 8 --rollout_lag 2"
EVALS = (
    "--total_steps 10 --eval_steps 2 --eval_from 8 --save_steps 2 --save_total_limit 1 "
    "--eval_dataset runs/smollm2/test_large.jsonl --eval_num_prompts 300"
)
LAST_STEPS = (8, 10)  # a run's accuracy: the mean of its evaluations at these steps

# tag -> (the scripts, the extra flags): one evals.compare study each, run seed by seed
# (scripts/study67.sh)
STUDIES = {
    "study67": ("grpo,gspo,ctpo,p3o", f"{OFF_POLICY} {EVALS}"),
    # SNIB's own KL term (its Table 1); its per-row log-weights kept (--dump_stats_steps)
    "study67_snib": ("snib", f"{OFF_POLICY} {EVALS} --beta 0.1 --dump_stats_steps 1"),
    "study67_on": (
        "grpo",
        f"--temperature 0.7 {EVALS}",
    ),  # GRPO on-policy: one optimizer step a batch
}
ARMS = {  # arm -> (study tag, script)
    "grpo": ("study67", "grpo"),
    "gspo": ("study67", "gspo"),
    "ctpo": ("study67", "ctpo"),
    "p3o": ("study67", "p3o"),
    "snib": ("study67_snib", "snib"),
    "grpo_on": ("study67_on", "grpo"),
}
SEEDS = 10  # from the pilot (main below); seeds 1..SEEDS, never 100 and above
MARGIN = 5.0  # points: parity and "matches" are within this; a clip share's drift too
EFFECT = 10.0  # points: the difference of accuracy the study is sized to find
BUDGET_HOURS = 14.0
# The untrained model's accuracy on the study's 300 held-out sums, greedy, step 0 (measured once:
# `python grpo.py --preset smollm2 --temperature 0.7 --total_steps 1 --eval_steps 1 --eval_from 0
# --eval_dataset runs/smollm2/test_large.jsonl --eval_num_prompts 300`, at 04e7ddc).
UNTRAINED = 19.3
HALF_WIDTH = 6.0  # points: the widest 95% interval, each side, the study aims for (its plan)


def accuracy(run: dict) -> float:
    """A run's held-out accuracy in points: the mean of its evaluations at LAST_STEPS."""
    at = dict(run["evals"])
    return 100 * statistics.mean(at[step] for step in LAST_STEPS)


def step_ten(run: dict) -> float:
    """A pilot run's held-out accuracy at step 10, in points."""
    return 100 * dict(run["evals"])[10]


def clip_share(run: dict) -> float:
    """The share of its weights (tokens or completions: the script's policy/clip_frac) the run's
    clip changed, in points, its mean over the steps."""
    return 100 * statistics.mean(value for _, value in run["series"]["policy/clip_frac"])


def clip_drift(run: dict) -> float:
    """The clip share's mean over steps 6-10 minus its mean over steps 1-5, in points."""
    series = run["series"]["policy/clip_frac"]
    late = statistics.mean(v for step, v in series if step > 5)
    early = statistics.mean(v for step, v in series if step <= 5)
    return 100 * (late - early)


def p3o_tightening(run: dict) -> float:
    """P3O's capped share of tokens on stale batches (steps 3-10, two steps stale) minus at step 1
    (the first batch, sampled by the weights it trains), in points."""
    series = dict(run["series"]["p3o/capped_frac"])
    return 100 * (statistics.mean(series[step] for step in range(3, 11)) - series[1])


@dataclass
class Claim:
    paper: str
    quote: str
    effect: str  # what is measured, seed by seed
    low: float  # the region the claim puts the effect in: low < effect < high
    high: float

    def values(self, runs: dict[str, dict[int, dict]], seed: int) -> float:
        return EFFECTS[self.effect](runs, seed)


def _diff(arm: str, other: str, statistic=accuracy):
    return lambda runs, seed: statistic(runs[arm][seed]) - statistic(runs[other][seed])


EFFECTS = {
    "snib - gspo, accuracy": _diff("snib", "gspo"),
    "snib clip share": lambda runs, seed: clip_share(runs["snib"][seed]),
    "ctpo - gspo, accuracy": _diff("ctpo", "gspo"),
    "ctpo - grpo, accuracy": _diff("ctpo", "grpo"),
    "ctpo clip share inside grpo's..gspo's": lambda runs, seed: min(
        clip_share(runs["ctpo"][seed]) - clip_share(runs["grpo"][seed]),
        clip_share(runs["gspo"][seed]) - clip_share(runs["ctpo"][seed]),
    ),
    "ctpo clip share, steps 6-10 minus 1-5": lambda runs, seed: clip_drift(runs["ctpo"][seed]),
    "p3o - grpo, accuracy": _diff("p3o", "grpo"),
    "p3o capped share, stale minus fresh": lambda runs, seed: p3o_tightening(runs["p3o"][seed]),
    "grpo on-policy - off-policy, accuracy": _diff("grpo_on", "grpo"),
}

SNIB = "Principled Policy Optimization for LLMs via Self-Normalized Importance Sampling"
CTPO = "Rethinking Importance Sampling in LLM Policy Optimization: A Cumulative Token Perspective"
P3O = "Trust the Batch, On- or Off-Policy: Adaptive Policy Optimization for RL Post-Training"
LANDSCAPE = "Towards Understanding the Optimization Landscape of GRPO and its Variants"
CLAIMS = [
    Claim(
        SNIB,
        "SNIB leverages principled self-normalized importance sampling to achieve the stability of "
        "modern methods without sacrificing asymptotic correctness",
        "snib - gspo, accuracy",
        -MARGIN,
        math.inf,
    ),
    Claim(
        SNIB,
        "our analysis reveals that epsilon = 0.2 clipping leaves > 95% of weights unchanged",
        "snib clip share",
        -math.inf,
        5.0,
    ),
    Claim(
        CTPO,
        "On Qwen3-4B, CTPO outperforms the strongest baseline GSPO by 3.7 points on average",
        "ctpo - gspo, accuracy",
        0.0,
        math.inf,
    ),
    Claim(
        CTPO,
        "CTPO achieves higher AIME 2025 accuracy than both baselines throughout training",
        "ctpo - grpo, accuracy",
        0.0,
        math.inf,
    ),
    Claim(
        CTPO,
        "The clip fraction of CTPO lies between that of GRPO and GSPO",
        "ctpo clip share inside grpo's..gspo's",
        0.0,
        math.inf,
    ),
    Claim(
        CTPO,
        "and remains stable throughout training",
        "ctpo clip share, steps 6-10 minus 1-5",
        -MARGIN,
        MARGIN,
    ),
    Claim(
        P3O,
        "Experiments across a wide range of settings show that our method matches or exceeds"
        " tuned baselines, introducing no new objective hyper-parameters",
        "p3o - grpo, accuracy",
        -MARGIN,
        math.inf,
    ),
    Claim(
        P3O,
        "the update [...] tightens automatically when stale or mismatched data cause ratio"
        " concentration, while retaining a nonzero learning signal on high-ratio tokens",
        "p3o capped share, stale minus fresh",
        0.0,
        math.inf,
    ),
    Claim(
        LANDSCAPE,
        "We find that using GRPO in on-policy setting remains significantly stable and on-par"
        " with GRPO in off-policy setting with clipping",
        "grpo on-policy - off-policy, accuracy",
        -MARGIN,
        MARGIN,
    ),
]


def read_runs(folder: str, arms: dict = ARMS) -> dict[str, dict[int, dict]]:
    """arm -> seed -> run result, from the three study files in `folder` (study67*.json, or
    runs/compare-TAG/ study.json where `folder` is runs/, or the finished runs carried in
    folder/TAG/ where `folder` is docs/studies/unfinished/)."""
    runs: dict[str, dict[int, dict]] = {arm: {} for arm in arms}
    for arm, (tag, script) in arms.items():
        for path in (
            os.path.join(folder, f"{tag}.json"),
            os.path.join(folder, f"compare-{tag}", "study.json"),
            os.path.join(folder, tag),  # the finished runs carried (scripts/study_carry.sh)
        ):
            if os.path.isdir(path):
                results = []
                for name in sorted(os.listdir(path)):
                    if name.endswith(".result.json"):
                        with open(os.path.join(path, name)) as f:
                            results.append(json.load(f))
            elif os.path.exists(path):
                with open(path) as f:
                    results = json.load(f)["results"]
            else:
                continue
            for result in results:
                if result["algo"] == script:
                    runs[arm][result["seed"]] = result
            break
    return runs


# Issue 69's comparison, planned before its runs (docs/estimators/sdpo.md): sdpo.py at its defaults
# in the on-policy arm's command, against that arm's own runs seed for seed; one claim ("SDPO's
# accuracy above GRPO's"), so no correction; the study's statistic, test and rule.
SDPO_ARMS = {"sdpo": ("sdpo_smollm2", "sdpo"), "grpo_on": ARMS["grpo_on"]}


def first_teacher_gap(folder: str, tag: str, run: str) -> float | None:
    """A carried SDPO run's sdpo/teacher_gap at its first step with a re-prompted row (a step
    without one logs 0 for want of tokens), or None where it has none."""
    path = os.path.join(folder, tag, run, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row.get("sdpo/reprompted_frac", 0) > 0 and "sdpo/teacher_gap" in row:
                return row["sdpo/teacher_gap"]
    return None


def sdpo_table(folder: str) -> list[str]:
    """The lines of docs/estimators/sdpo.md's real-model result (docs/make_diffs.py writes them):
    per seed SDPO's and GRPO on-policy's accuracy, SDPO's minus GRPO's, and SDPO's teacher gap at
    its first step with a re-prompted row; the mean difference, its 95% interval, p against
    "above 0" and the verdict."""
    runs = read_runs(folder, SDPO_ARMS)
    seeds = sorted(set(runs["sdpo"]) & set(runs["grpo_on"]))
    same = [
        runs["sdpo"][s]["series"]["reward/mean"][:1] == runs["grpo_on"][s]["series"]["reward/mean"][:1] for s in seeds
    ]
    lines = [
        f"Seeds finished by both: {len(seeds)} ({', '.join(map(str, seeds)) or 'none'}) of {SEEDS} "
        f"planned; SDPO runs finished: {len(runs['sdpo'])}. Both trained on the same first rollouts "
        "in each of them: " + ("yes." if all(same) else "no."),
        "",
        "| seed | SDPO | GRPO on-policy | SDPO - GRPO | teacher gap, first re-prompted step (nats/token) |",
        "| --- | --- | --- | --- | --- |",
    ]
    values = []
    for seed in seeds:
        ours, theirs = accuracy(runs["sdpo"][seed]), accuracy(runs["grpo_on"][seed])
        values.append(ours - theirs)
        gap = first_teacher_gap(folder, SDPO_ARMS["sdpo"][0], f"sdpo__s{seed}")
        gap_text = "-" if gap is None else f"{gap:+.3f}"
        lines.append(f"| {seed} | {ours:.1f}% | {theirs:.1f}% | {ours - theirs:+.1f} | {gap_text} |")
    lines += ["", under_untrained("SDPO runs", runs["sdpo"])]
    if len(seeds) < 2:
        return lines + ["", "No interval yet: fewer than two seeds finished by both."]
    summary = paired_t(values)
    p = claim_p(summary, 0.0, math.inf)
    rule = verdict(summary, 0.0, math.inf, p)
    name = "verdict" if len(seeds) >= SEEDS else "the rule so far (no verdict before all seeds)"
    return lines + [
        "",
        f"SDPO - GRPO: {summary.mean:+.1f} points, 95% interval [{summary.low:+.1f}, "
        f"{summary.high:+.1f}] over {len(seeds)} seeds; claimed: > 0; p {p:.3g}; {name}: {rule}.",
    ]


def under_untrained(what: str, runs: dict[int, dict]) -> str:
    """The line that counts the runs (seed -> result) whose accuracy ends under the untrained
    model's, and names their seeds."""
    below = sorted(seed for seed, run in runs.items() if accuracy(run) < UNTRAINED)
    listed = f" ({', '.join(map(str, below))})" if below else ""
    return f"{what} ending under the untrained model's {UNTRAINED}%: {len(below)} of {len(runs)}{listed}."


def snib_table(folder: str) -> list[str]:
    """The lines of docs/estimators/snib.md's study runs (docs/make_diffs.py writes them): per SNIB
    seed its accuracy, its training reward at the first and the last step, and the extremes over
    its steps of the diagnostics of a collapse: the mean group ESS (least), the raw log-weights'
    standard deviation and the KL to the reference (most); then how many seeds ended under the
    untrained model."""
    runs = read_runs(folder, {"snib": ARMS["snib"]})["snib"]
    lines = [
        "| seed | accuracy | training reward, step 1 -> 10 | least group ESS (step) | "
        "most log-weight std | most KL to the reference (step) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for seed in sorted(runs):
        series = runs[seed]["series"]
        reward = dict(series["reward/mean"])
        ess_step, ess = min(series["snib/ess"], key=lambda point: point[1])
        kl_step, kl = max(series["policy/kl"], key=lambda point: point[1])
        spread = max(value for _, value in series["snib/raw_logweight_std"])
        lines.append(
            f"| {seed} | {accuracy(runs[seed]):.1f}% | {reward[min(reward)]:.3f} -> {reward[max(reward)]:.3f} | "
            f"{ess:.2f} ({ess_step}) | {spread:.2f} | {kl:.3g} ({kl_step}) |"
        )
    return lines + ["", under_untrained("Seeds", runs)]


# The pilot of SNIB's stop-gradient KL term (docs/estimators/snib.md), planned before its runs: the
# study's SNIB command with --kl_weight_grad false, seeds 1-4, each against the study's SNIB run of
# its seed. A pilot: its interval is reported, no verdict.
SNIB_SG_ARMS = {"sg": ("study67_snib_sg", "snib"), "snib": ARMS["snib"]}


def snib_sg_table(folder: str) -> list[str]:
    """The lines of docs/estimators/snib.md's pilot (docs/make_diffs.py writes them): per seed the
    stop-gradient run's accuracy, its training reward at the first and the last step and its
    largest KL to the reference, the study's SNIB run's accuracy and the difference; the runs under
    the untrained model; the mean difference with its 95% t interval."""
    runs = read_runs(folder, SNIB_SG_ARMS)
    seeds = sorted(set(runs["sg"]) & set(runs["snib"]))
    same = [runs["sg"][s]["series"]["reward/mean"][:1] == runs["snib"][s]["series"]["reward/mean"][:1] for s in seeds]
    lines = [
        f"Seeds finished: {len(seeds)} ({', '.join(map(str, seeds)) or 'none'}). Each trained on the same "
        "first rollouts as the study's SNIB run of its seed: " + ("yes." if all(same) else "no."),
        "",
        "| seed | `--kl_weight_grad false` | training reward, step 1 -> 10 | most KL to the reference (step) | "
        "the study's SNIB | difference |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    values = []
    for seed in seeds:
        series = runs["sg"][seed]["series"]
        reward = dict(series["reward/mean"])
        kl_step, kl = max(series["policy/kl"], key=lambda point: point[1])
        ours, theirs = accuracy(runs["sg"][seed]), accuracy(runs["snib"][seed])
        values.append(ours - theirs)
        lines.append(
            f"| {seed} | {ours:.1f}% | {reward[min(reward)]:.3f} -> {reward[max(reward)]:.3f} | "
            f"{kl:.3g} ({kl_step}) | {theirs:.1f}% | {ours - theirs:+.1f} |"
        )
    finished = {seed: runs["sg"][seed] for seed in seeds}
    lines += ["", under_untrained("Runs with `--kl_weight_grad false`", finished)]
    if len(seeds) < 2:
        return lines + ["", "No interval yet: fewer than two seeds finished."]
    summary = paired_t(values)
    return lines + [
        "",
        f"`--kl_weight_grad false` - the study's SNIB: {summary.mean:+.1f} points, 95% interval "
        f"[{summary.low:+.1f}, {summary.high:+.1f}] over {len(seeds)} seeds (a pilot: no verdict).",
    ]


def verdicts(runs: dict[str, dict[int, dict]]) -> list[dict]:
    """Each claim's effect over the seeds every arm finished: its paired t summary, raw and
    Holm-adjusted p (over all the claims) and verdict."""
    seeds = sorted(set.intersection(*(set(by_seed) for by_seed in runs.values())))
    rows = []
    for claim in CLAIMS:
        values = [claim.values(runs, seed) for seed in seeds]
        summary = paired_t(values)
        rows.append(
            {
                "claim": claim,
                "seeds": seeds,
                "values": values,
                "summary": summary,
                "p": claim_p(summary, claim.low, claim.high),
            }
        )
    for row, adjusted in zip(rows, holm([row["p"] for row in rows])):
        row["holm_p"] = adjusted
        row["verdict"] = verdict(row["summary"], row["claim"].low, row["claim"].high, adjusted)
    return rows


def verdict_table(folder: str) -> list[str]:
    """The results' lines of docs/study-plan.md (docs/make_diffs.py writes them): the seeds every
    arm finished, each arm's accuracy over them, and per claim its effect, 95% interval and its
    half-width, the region it claims, raw and Holm p, and the verdict."""
    runs = read_runs(folder)
    shared = first_rollouts_shared(runs)
    seeds = sorted(shared)
    done = {arm: len(by_seed) for arm, by_seed in runs.items()}
    lines = [
        f"Seeds finished by every arm: {len(seeds)} ({', '.join(map(str, seeds)) or 'none'}) of "
        f"{SEEDS} planned; runs finished per arm: "
        + ", ".join(f"{arm} {n}" for arm, n in done.items())
        + ". Every arm trained on the same first rollouts in each of them: "
        + ("yes." if all(shared.values()) else "no.")
    ]
    if len(seeds) < 2:
        return lines + ["", "No interval yet: fewer than two seeds finished by every arm."]

    lines += [
        "",
        "| arm | accuracy by seed (%) | mean | sd | least | most |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for arm, by_seed in runs.items():  # descriptive: each arm's own accuracy over the same seeds
        values = [accuracy(by_seed[seed]) for seed in seeds]
        lines.append(
            f"| {arm} | {', '.join(f'{v:.1f}' for v in values)} | {statistics.mean(values):.1f} | "
            f"{statistics.stdev(values):.1f} | {min(values):.1f} | {max(values):.1f} |"
        )

    def region(claim: Claim) -> str:
        if math.isinf(claim.high):
            return f"> {claim.low:+g}"
        if math.isinf(claim.low):
            return f"< {claim.high:+g}"
        return f"{claim.low:+g} .. {claim.high:+g}"

    lines += [
        "",
        "| paper | effect (points) | seed by seed | mean | 95% interval | half-width | claimed | p | Holm p | "
        + ("verdict |" if len(seeds) >= SEEDS else "the rule so far (no verdict before all seeds) |"),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    short = {SNIB: "SNIB", CTPO: "CTPO", P3O: "P3O", LANDSCAPE: "landscape"}
    wide = []  # (claim, seeds its interval needs at most HALF_WIDTH each side, at its measured spread)
    rows = verdicts(runs)
    for row in rows:
        claim, summary = row["claim"], row["summary"]
        by_seed = ", ".join(f"{v:+.1f}" for v in row["values"])
        half = (summary.high - summary.low) / 2
        if half > HALF_WIDTH:
            # the interval's width alone: seeds_needed's power condition off
            wide.append((claim, seeds_needed(0.0, summary.sd, power=0.0, half_width=HALF_WIDTH)))
        lines.append(
            f"| {short[claim.paper]} | {claim.effect} | {by_seed} | {summary.mean:+.1f} | "
            f"[{summary.low:+.1f}, {summary.high:+.1f}] | {half:.1f} | {region(claim)} | "
            f"{row['p']:.3g} | {row['holm_p']:.3g} | {row['verdict']} |"
        )
    needs = "; ".join(f"{short[claim.paper]} {claim.effect}: {n}" for claim, n in wide)
    return lines + [
        "",
        f"Intervals at most {HALF_WIDTH:g} points wide on each side: {len(rows) - len(wide)} of "
        f"{len(rows)} claims."
        + (f" Seeds the others would need for it, at the spread measured here: {needs}." if wide else ""),
    ]


def pilot_sd(folder: str = "docs/studies", steps=(10,)) -> tuple[float, int]:
    """The pooled standard deviation of the pilot's paired differences of accuracy (the mean at
    `steps`) (points), every off-policy estimator but SNIB against GRPO's same seed and GRPO
    on-policy against off-policy, with its degrees of freedom: each comparison's sum of squares
    about its own mean, over the sum of (pairs - 1)."""
    at = {}
    for tag, suffix in (("offpolicy13", ""), ("offpolicy13_more", ""), ("onpolicy_ref", "_on")):
        with open(os.path.join(folder, f"{tag}.json")) as f:
            for r in json.load(f)["results"]:
                evals = dict(r["evals"])
                at[(r["algo"] + suffix, r["seed"])] = 100 * statistics.mean(evals[k] for k in steps)
    squares, df = 0.0, 0
    for arm in sorted({a for a, _ in at} - {"grpo", "snib"}):
        diffs = [at[(arm, s)] - at[("grpo", s)] for (a, s) in at if a == arm]
        squares += (len(diffs) - 1) * statistics.variance(diffs)
        df += len(diffs) - 1
    return math.sqrt(squares / df), df


def pilot_runs(folder: str = "docs/studies") -> dict[str, dict[int, dict]]:
    """The pilot's runs of the study's arms, arm -> seed -> result (SNIB's without its KL term)."""
    runs: dict[str, dict[int, dict]] = {}
    for arm, (tag, script) in ARMS.items():
        name = "onpolicy_ref" if arm == "grpo_on" else "offpolicy13"
        with open(os.path.join(folder, f"{name}.json")) as f:
            results = json.load(f)["results"]
        runs[arm] = {r["seed"]: r for r in results if r["algo"] == script}
    return runs


def pilot_minutes(folder: str = "docs/studies") -> dict[str, float]:
    """The mean minutes of a pilot run (the whole command, evaluations included) of each arm's
    script."""
    minutes = {}
    for arm, (tag, script) in ARMS.items():
        name = "onpolicy_ref" if arm == "grpo_on" else "offpolicy13"
        with open(os.path.join(folder, f"{name}.json")) as f:
            runs = [r for r in json.load(f)["results"] if r["algo"] == script]
        minutes[arm] = statistics.mean(r["seconds"] / 60 for r in runs)
    return minutes


def commands(seed: int) -> list[str]:
    """The three evals.compare commands that run seeds 1..seed of the study (finished runs are read,
    not run)."""
    return [
        f"python -m evals.compare --algos {algos} --preset smollm2 --seeds {seed} "
        "--jobs 1 --threads 1 "
        f"--extra '{extra}' --tag {tag} --resume"
        for tag, (algos, extra) in STUDIES.items()
    ]


def spent_minutes(runs_dir: str) -> list[float]:
    """The minutes of each finished run of the study under runs_dir (its result files: the whole
    command's wall time, one thread; a resumed run's is its last process's)."""
    minutes = []
    for tag in STUDIES:
        folder = os.path.join(runs_dir, f"compare-{tag}")
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
            if name.endswith(".result.json"):
                with open(os.path.join(folder, name)) as f:
                    minutes.append(json.load(f)["seconds"] / 60)
    return minutes


def progress(runs_dir: str) -> list[str]:
    """One line per finished run of the study under runs_dir: its minutes (the whole command), its
    training minutes, each evaluation's seconds and its machine; then the total and the seeds that
    every arm finished."""
    lines, done = [], {}
    for arm, (tag, script) in ARMS.items():
        folder = os.path.join(runs_dir, f"compare-{tag}")
        for path in sorted(glob.glob(os.path.join(folder, f"{script}__s*.result.json"))):
            with open(path) as f:
                r = json.load(f)
            done.setdefault(arm, set()).add(r["seed"])
            evals = ", ".join(f"{s:.0f}" for s in r.get("eval_seconds", []))
            lines.append(
                f"{tag} {script} seed {r['seed']}: {r['seconds'] / 60:.1f} min, training "
                f"{r['minutes'][-1]:.1f}, evaluations {evals} s ({r['machine']})"
            )
    complete = sorted(set.intersection(*(done.get(arm, set()) for arm in ARMS)))
    minutes = spent_minutes(runs_dir)
    hours = sum(minutes) / 60
    lines.append(f"{len(minutes)} runs, {hours:.2f} CPU-hours; complete seeds {complete}")
    return lines


def within_budget(
    minutes: list[float],
    arms: int = len(ARMS),
    budget_hours: float = BUDGET_HOURS,
) -> bool:
    """Whether one more seed fits: the minutes spent plus a seed's arms at the mean minutes of a
    finished run (14 before any finished) stay within the budget."""
    per_run = statistics.mean(minutes) if minutes else 14.0
    return sum(minutes) + arms * per_run <= budget_hours * 60


def first_rollouts_shared(runs: dict[str, dict[int, dict]], steps: int = 3) -> dict[int, bool]:
    """Seed by seed, whether every off-policy arm trained on the same rewards at its first `steps`
    steps (under --rollout_lag 2 the first three batches are sampled by the initial weights: the
    same rollouts for every arm), and GRPO on-policy at its first."""
    shared = {}
    seeds = set.intersection(*(set(by_seed) for by_seed in runs.values()))
    for seed in sorted(seeds):
        off = [arm for arm in ARMS if arm != "grpo_on"]
        first = [runs[arm][seed]["series"]["reward/mean"][:steps] for arm in off]
        on = runs["grpo_on"][seed]["series"]["reward/mean"][:1]
        shared[seed] = all(f == first[0] for f in first) and on == first[0][:1]
    return shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--verdicts", metavar="DIR", help="the folder of the study files")
    add("--minutes", type=float, default=14.0, help="minutes of one core a run, measured")
    add("--seeds", action="store_true", help="print the planned number of seeds")
    add("--commands", type=int, metavar="SEED", help="print the commands up to SEED")
    add("--budget", metavar="RUNS", help="exit 1 when the next seed would pass the budget")
    add("--next", type=int, default=1, help="with --budget: the seed about to start")
    add("--progress", metavar="RUNS", help="the finished runs, their minutes and machines")
    args = parser.parse_args()
    if args.seeds:
        print(SEEDS)
        return
    if args.commands:
        print("\n".join(commands(args.commands)))
        return
    if args.progress:
        print("\n".join(progress(args.progress)))
        return
    if args.budget:
        minutes = spent_minutes(args.budget)
        fits = within_budget(minutes)
        print(
            f"{len(minutes)} runs finished, {sum(minutes) / 60:.2f} CPU-hours of "
            f"{BUDGET_HOURS:.0f}: seed "
            f"{args.next} {'starts' if fits else 'would pass the budget; the study stops'}"
        )
        raise SystemExit(0 if fits else 1)
    if args.verdicts:
        runs = read_runs(args.verdicts)
        shared = first_rollouts_shared(runs)
        print(f"the same first rollouts, by seed: {shared}")
        if len(shared) < 2:
            print("fewer than two seeds finished by every arm: no interval yet")
            return
        for row in verdicts(runs):
            s = row["summary"]
            print(
                f"{row['claim'].effect}: {s.mean:+.1f} [{s.low:+.1f}, {s.high:+.1f}] over seeds "
                f"{row['seeds']}, p {row['p']:.3g}, Holm {row['holm_p']:.3g}: {row['verdict']}"
            )
        return
    sd, df = pilot_sd()
    family = len(CLAIMS)
    print(f"pilot: pooled sd of paired step-10 differences {sd:.2f} points ({df} df)")
    sd_mean, _ = pilot_sd(steps=(5, 10))
    print(f"pilot: the same of each run's mean at steps 5 and 10: {sd_mean:.2f} points")
    for effect in (6.0, 8.0):
        n = seeds_needed(effect, sd_mean, alpha=0.05 / len(CLAIMS), half_width=6.0)
        print(f"  with it, an effect of {effect:.0f} points: {n} seeds")
    for effect in (6.0, 8.0, EFFECT, 12.0):
        n = seeds_needed(effect, sd, alpha=0.05 / family, half_width=6.0)
        print(
            f"  an effect of {effect:.0f} points at 0.05 / {family} (Holm's first step), "
            "power 0.8, 95% "
            f"half-width <= 6: {n} seeds"
        )
    shared = first_rollouts_shared(pilot_runs())
    print(f"pilot: the same rewards at steps 1-3 for every off-policy arm, by seed: {shared}")
    pilot = pilot_runs()
    for other in ("gspo", "grpo"):
        diffs = [_diff("snib", other, step_ten)(pilot, seed) for seed in sorted(pilot["snib"])]
        spread = statistics.stdev(diffs)
        print(f"pilot: sd of SNIB's step-10 differences from {other}: {spread:.1f}")
    finished = [r for by_seed in pilot.values() for r in by_seed.values()]
    outside = [r["seconds"] / 60 - r["minutes"][-1] for r in finished]
    print(
        f"pilot: minutes a run outside training (loading, evaluations): {min(outside):.1f}-"
        f"{max(outside):.1f}, mean {statistics.mean(outside):.1f}"
    )
    by_arm = pilot_minutes()
    listed = ", ".join(f"{arm} {m:.1f}" for arm, m in by_arm.items())
    print(f"pilot minutes a run: {listed}; mean {statistics.mean(by_arm.values()):.1f}")
    half = t_quantile(0.975, SEEDS - 1) * sd / math.sqrt(SEEDS)
    runs = len(ARMS) * SEEDS
    print(
        f"{SEEDS} seeds: expected 95% half-width {half:.2f} points; {len(ARMS)} arms x "
        f"{SEEDS} seeds = {runs} runs x {args.minutes:.1f} min = "
        f"{runs * args.minutes / 60:.1f} CPU-hours (budget {BUDGET_HOURS:.0f})"
    )


if __name__ == "__main__":
    main()
