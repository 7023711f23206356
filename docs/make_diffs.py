"""Write the code the docs quote from the scripts, so a page cannot drift from the code it shows.

A page holds a generated block between two HTML comments (invisible on GitHub and on the site):

    <!-- begin: diff -u grpo.py gspo.py -->      the unified diff of grpo.py and gspo.py, as `diff -u` prints it
    <!-- begin: algo grpo.py -->                  grpo.py's `# ALGO LOGIC` section, from that line up to `def main(`
    <!-- begin: layout common -->                 every module of common/ by folder, with its lines (each line's
                                                  description is kept from the page; a module without one is stale)
    <!-- begin: imports common -->               common/'s floors (FLOORS), top first: each
                                                  module with the modules of common/ it imports
                                                  (tests/test_siblings.py holds every import to
                                                  its own floor or one below)
    ```diff / ```python ... ```
    <!-- end -->

    <!-- begin: study tag -->                     the table of a study's results, from docs/studies/tag.json (what
    | ... |                                       `python -m evals.compare ... --tag tag` wrote as study.json: its
    <!-- end -->                                  command, commit and every run's evaluations), so a figure of a
                                                  study has one source: its runs' own file; `study tag grpo,ipo`:
                                                  those estimators' rows only
    <!-- begin: verdicts folder -->               the real-model study's claims (docs/study-plan.md; evals/plan.py):
    <!-- end -->                                  the seeds every arm finished, each claim's effect, interval, p,
                                                  Holm's p and verdict, from the runs in that folder
    <!-- begin: sdpo-verdict folder -->           sdpo.py against GRPO on-policy on the real model, seed by seed,
    <!-- end -->                                  from the runs in that folder (evals/plan.py sdpo_table)
    <!-- begin: snib-runs folder -->              the real-model study's SNIB runs, seed by seed: accuracy, reward,
    <!-- end -->                                  the extremes of group ESS, log-weight spread and KL (snib_table)
    <!-- begin: snib-sg-pilot folder -->          the pilot of SNIB's stop-gradient KL term against the study's SNIB
    <!-- end -->                                  runs, seed by seed, with its interval (snib_sg_table)
    <!-- begin: study-vs tag grpo -->             each estimator of the study against grpo: the difference of final
                                                  accuracy, its exact permutation p over seeds (evals/stats.py), and
                                                  the runs' mean ESS, log-ratio std, clip fraction, entropy, KL and
                                                  training minutes (what evals.compare's run_record kept)

An excerpt (`<!-- excerpt: diff -u grpo.py gspo.py -->` before a ```diff block) is not rewritten: each of its `-` / `+`
lines must be a line of the live diff. tests/test_docs.py runs `check()`; after changing a script, run

    python docs/make_diffs.py          # rewrite every generated block in README.md and docs/
    python docs/make_diffs.py --check  # exit 1 and name each stale block
"""

import difflib
import glob
import json
import os
import re
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as `python docs/make_diffs.py`: the repository's evals/ (evals.stats) on the path
BLOCK = re.compile(r"(?P<begin><!-- begin: (?P<what>diff -u grpo\.py (?P<diff>\w+)\.py|algo (?P<algo>\w+)\.py"
                   r"|layout common|imports common"
                   r"|study (?P<study>[a-z0-9_.-]+)(?: (?P<only>[a-z0-9_,]+))?"
                   r"|study-vs (?P<vs_study>[a-z0-9_.-]+) (?P<base>[a-z0-9_]+)"
                   r"|verdicts (?P<verdicts>[a-z0-9_/.-]+)|sdpo-verdict (?P<sdpo>[a-z0-9_/.-]+)"
                   r"|snib-runs (?P<snib>[a-z0-9_/.-]+)|snib-sg-pilot (?P<snib_sg>[a-z0-9_/.-]+)) -->\n)"
                   r"(?P<body>.*?)(?P<end><!-- end -->)", re.S)
# A block's group -> the function of evals/plan.py that writes its lines from a folder of runs.
PLAN_TABLES = {"verdicts": "verdict_table", "sdpo": "sdpo_table", "snib": "snib_table",
               "snib_sg": "snib_sg_table"}
# The layout block's folders, in order: the step's own parts first, then the machinery by role.
FOLDER_ORDER = ["common", "common/engines", "common/tasks", "common/models", "common/run_folder", "common/rails"]
# common/'s floors, bottom first: a module imports only modules of its own floor or of one below
# (tests/test_siblings.py), so the drawing of the imports reads from the top down.
FLOORS = [
    ("a step's arithmetic and metrics", ["common/nucleus.py", "common/logprobs.py",
                                         "common/metrics.py",
                                         "common/offpolicy.py", "common/dapo.py"]),
    ("where the policy lives", ["common/models"]),
    ("who samples", ["common/engines"]),
    ("what is learned and scored", ["common/tasks"]),
    ("a step's batch", ["common/sampling.py"]),
    ("the run folder", ["common/run_folder"]),
    ("the rails", ["common/rails"]),
    ("the command line", ["common/args.py"]),
    ("the run", ["common/run.py"]),
]
EXCERPT = re.compile(r"<!-- excerpt: diff -u grpo\.py (\w+)\.py -->\n```diff\n(.*?)```", re.S)


def read_lines(script: str) -> list[str]:
    with open(os.path.join(ROOT, script)) as f:
        return f.read().splitlines()


def live_diff(name: str) -> list[str]:
    """`diff -u grpo.py NAME.py` (3 lines of context), without the files' dates."""
    return list(difflib.unified_diff(read_lines("grpo.py"), read_lines(f"{name}.py"), "grpo.py", f"{name}.py",
                                     lineterm=""))


def algo_section(name: str) -> list[str]:
    """The script's `# ALGO LOGIC` section: compute_advantages, batch_stats, compute_loss and their helpers."""
    lines = read_lines(f"{name}.py")
    start = next(i for i, line in enumerate(lines) if line.startswith("# ALGO LOGIC"))
    end = next(i for i, line in enumerate(lines) if line.startswith("def main("))
    return lines[start:end]


def described(block: str) -> dict[str, str]:
    """{path: description} from a layout block's module lines ("  name.py  LINES  description")."""
    found = {}
    folder = None
    for line in block.splitlines():
        if line.startswith("common"):
            folder = line.split()[0].rstrip("/")
        elif folder and line.startswith("  "):
            name, _, rest = line.strip().partition(" ")
            found[f"{folder}/{name}"] = rest.strip().partition(" ")[2].strip()
    return found


def layout(block: str) -> list[str]:
    """common/'s folders, each with the first sentence of its docstring, and their modules with their lines and the
    description the page gave them (modules keep the page's order; a new one comes last, marked undescribed)."""
    import ast

    descriptions = described(block)
    order = list(descriptions)
    body = []
    for folder in FOLDER_ORDER:
        with open(os.path.join(ROOT, folder, "__init__.py")) as f:
            doc = " ".join((ast.get_docstring(ast.parse(f.read())) or "").split())
        body.append(f"{folder + '/':20s}{doc.split('. ')[0].rstrip('.')}")
        names = [n for n in os.listdir(os.path.join(ROOT, folder)) if n.endswith(".py") and n != "__init__.py"]
        paths = sorted((f"{folder}/{n}" for n in names), key=lambda p: (p not in order, order.index(p)
                                                                         if p in order else 0, p))
        for path in paths:
            with open(os.path.join(ROOT, path)) as f:
                count = len(f.read().splitlines())
            text = descriptions.get(path) or "UNDESCRIBED: say what this module holds"
            body.append(f"  {os.path.basename(path):20s}{count:5d}  {text}")
    return body


def common_modules() -> list[str]:
    """Every module of common/ but the packages' __init__.py, as a path from the repository's
    root."""
    paths = glob.glob(os.path.join(ROOT, "common", "**", "*.py"), recursive=True)
    return sorted(os.path.relpath(p, ROOT) for p in paths if not p.endswith("__init__.py"))


def floor_of(path: str) -> int | None:
    """The index in FLOORS of the floor holding `path` (a module, or a folder's module), or None."""
    for i, (_, members) in enumerate(FLOORS):
        if path in members or os.path.dirname(path) in members:
            return i
    return None


def imports_of(path: str) -> set[str]:
    """The modules of common/ that `path` imports: import statements at the top or inside a
    function, importlib.import_module of a literal, and a string that is a module's whole name (a
    registry's value, such as PRESET_MODULES' "common.tasks.toy")."""
    import ast

    from benchmarks.copy_cost import all_imports, module_file

    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    names = all_imports(os.path.join(ROOT, path))
    names += [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
              and isinstance(n.value, str) and re.fullmatch(r"common(\.\w+)+", n.value)]
    found = {module_file(name) for name in names}
    return {os.path.relpath(f, ROOT) for f in found
            if f and not f.endswith("__init__.py") and os.path.relpath(f, ROOT) != path}


def import_floors() -> list[str]:
    """common/'s floors, top first: each module with the modules of common/ it imports."""
    body = []
    for i, (name, members) in reversed(list(enumerate(FLOORS))):
        shown = [m.removeprefix("common/") + ("" if m.endswith(".py") else "/") for m in members]
        body.append(f"{i + 1}. {name}: {', '.join(shown)}")
        for path in [p for p in common_modules() if floor_of(p) == i]:
            imported = sorted(m.removeprefix("common/").removesuffix(".py")
                              for m in imports_of(path))
            line = f"    {path.removeprefix('common/').removesuffix('.py'):24s}"
            for k, name in enumerate(imported or ["-"]):
                if len(line) + len(name) + 2 > 100:
                    body.append(line.rstrip())
                    line = " " * 28
                line += name + (", " if k < len(imported) - 1 else "")
            body.append(line)
    return body


def short(commits: str) -> str:
    """"0123456" for a study run at one commit; "0123456, 89abcde" for runs of several."""
    return ", ".join(c[:7] for c in commits.split(","))


def provenance(study: dict) -> str:
    """"commit 0123456" and, for runs that recorded it (evals.compare's machine()), the machines they ran on."""
    machines = study.get("machines") or []
    return f"commit {short(study['commit'])}" + (f"; ran on {'; '.join(machines)}" if machines else "")


def percent(x: float) -> str:
    return f"{100 * x:.1f}"


def mean_std(finals: list[float]) -> str:
    """"80.1 +- 1.8%": the mean and sample std over seeds, in percent; one seed has no std: "59.0%"."""
    if len(finals) == 1:
        return f"{percent(finals[0])}%"
    return f"{percent(statistics.mean(finals))} +- {percent(statistics.stdev(finals))}%"


def each_seed(finals: list[float]) -> str:
    """"81.2%, 78.0%, 81.0%": each seed's, in percent."""
    return ", ".join(f"{percent(x)}%" for x in finals)


def study_table(tag: str, only: str | None = None) -> list[str]:
    """A study's table from docs/studies/TAG.json: held-out greedy accuracy at the first and last evaluation of each
    estimator (`only`: these, comma-separated, in the study's order), mean +- std over seeds and each seed's. With
    --vary, a column per value of the varied flag, each cell the last evaluation's mean +- std (each seed's)."""
    with open(os.path.join(ROOT, "docs", "studies", f"{tag}.json")) as f:
        study = json.load(f)
    results = study["results"]
    algos = [a for a in dict.fromkeys(r["algo"] for r in results) if only is None or a in only.split(",")]
    values = list(dict.fromkeys(r["value"] for r in results))
    first, last = results[0]["evals"][0][0], results[0]["evals"][-1][0]
    flag = study.get("vary")
    seeds = sorted({r["seed"] for r in results})
    head = [f"`{study['command']}` ({provenance(study)}); held-out greedy accuracy over seed"
            f"{'s' if len(seeds) > 1 else ''} {', '.join(str(s) for s in seeds)}:", ""]

    def runs_of(algo, value):
        return sorted((r for r in results if r["algo"] == algo and r["value"] == value), key=lambda r: r["seed"])

    def minutes(runs):
        return f"{statistics.mean(r['seconds'] for r in runs) / 60:.1f}"

    if flag:
        lines = [f"| estimator | step {first} | " + " | ".join(f"{flag} {v}, step {last}" for v in values)
                 + " | minutes per run |", "| --- " * (3 + len(values)) + "|"]
        for algo in algos:
            every = [r for v in values for r in runs_of(algo, v)]
            cells = [algo, f"{percent(statistics.mean(r['evals'][0][1] for r in every))}%"]
            for value in values:
                finals = [r["evals"][-1][1] for r in runs_of(algo, value)]
                cells.append(f"{mean_std(finals)} ({each_seed(finals)})")
            lines.append("| " + " | ".join(cells + [minutes(every)]) + " |")
        return head + lines
    lines = [f"| estimator | step {first} | step {last}, mean +- std | each seed's | minutes per run |",
             "| --- " * 5 + "|"]
    for algo in algos:
        runs = runs_of(algo, None)  # no --vary: every run's value is None
        warm = statistics.mean(r["evals"][0][1] for r in runs)
        finals = [r["evals"][-1][1] for r in runs]
        cells = [algo, f"{percent(warm)}%", mean_std(finals), each_seed(finals), minutes(runs)]
        lines.append("| " + " | ".join(cells) + " |")
    return head + lines


def study_against(tag: str, base: str) -> list[str]:
    """Each estimator of docs/studies/TAG.json against `base` (no --vary): each evaluation's mean +- std but the
    first (the same start for all), the last one's difference from base's mean in points with the exact
    two-sided permutation p-value over seeds, then the mean
    over seeds of each run's mean over steps of the regime's diagnostics, and the training minutes to the last
    evaluation (a run recorded before run_record existed shows "-"). The clip column is `policy/clip_frac` (DPPO's:
    masked), or P3O's `p3o/capped_frac`; where Clip-Cov ran with its `covpo/selected_frac` recorded, a last column
    holds the share of tokens its covariance selection dropped."""
    from evals.stats import permutation_p, smallest_p

    with open(os.path.join(ROOT, "docs", "studies", f"{tag}.json")) as f:
        study = json.load(f)
    if study.get("vary"):
        raise SystemExit(f"error: docs/studies/{tag}.json varies --{study['vary']}: a study-vs block takes a study "
                         f"without --vary (it would pool the values)")
    results = study["results"]
    algos = list(dict.fromkeys(r["algo"] for r in results))
    finals = {a: [r["evals"][-1][1] for r in sorted(results, key=lambda r: r["seed"]) if r["algo"] == a]
              for a in algos}
    if base not in finals:
        raise SystemExit(f"error: docs/studies/{tag}.json has no runs of {base} to compare against")
    last = results[0]["evals"][-1][0]
    earlier = [step for step, _ in results[0]["evals"][1:-1]]  # the evaluations between the start and the last
    sizes = sorted({len(v) for a, v in finals.items() if a != base})
    floor = ", ".join(f"{smallest_p(n, len(finals[base])):.3g} with {n} seed{'s' if n > 1 else ''} against "
                      f"{len(finals[base])}" for n in sizes)
    before = "".join(f" at step {step} and" for step in earlier)
    head = [f"`{study['command']}` ({provenance(study)}). The held-out greedy accuracy{before} at step {last}, "
            f"step {last}'s difference from {base}'s mean and the exact permutation p-value of that difference over "
            f"seeds (the smallest p these seeds can give: {floor}); then each run's mean over its steps, averaged "
            f"over seeds:",
            "", "| estimator | " + "".join(f"step {step}, mean +- std | " for step in earlier) +
            "accuracy, mean +- std | vs " + base + " | p | ESS | log-ratio std | clip | entropy | KL | "
            "training minutes |", "| --- " * (10 + len(earlier)) + "|"]
    dropped = any("covpo/selected_frac" in r.get("diagnostics", {}) for r in results)
    if dropped:
        head[-2] += " dropped (Clip-Cov) |"
        head[-1] += " --- |"

    def diagnostic(algo, name, form):
        values = [r.get("diagnostics", {}).get(name) for r in results if r["algo"] == algo]
        return "-" if None in values else form(statistics.mean(values))

    def percent(x):
        return f"{100 * x:.1f}%"

    lines = []
    for algo in algos:
        runs = [r for r in results if r["algo"] == algo]
        gap = 100 * (statistics.mean(finals[algo]) - statistics.mean(finals[base]))
        versus, p = ("", "") if algo == base else (f"{gap:+.1f}", f"{permutation_p(finals[algo], finals[base]):.2f}")
        minutes = "-" if any("minutes" not in r for r in runs) else \
            f"{statistics.mean(r['minutes'][-1] for r in runs):.1f}"
        cells = [algo, mean_std(finals[algo]), versus, p,
                 diagnostic(algo, "policy/ess", lambda x: f"{x:.3f}"),
                 diagnostic(algo, "policy/log_ratio_std", lambda x: f"{x:.3f}"),
                 diagnostic(algo, "policy/clip_frac", percent),
                 diagnostic(algo, "policy/entropy", lambda x: f"{x:.3f}"),
                 diagnostic(algo, "policy/kl", lambda x: f"{x:.2g}"), minutes]
        if cells[6] == "-":  # P3O clips no ratio at 1 +- eps: it caps each at the batch's ESS
            cells[6] = diagnostic(algo, "p3o/capped_frac", percent)
        if dropped:
            cells.append(diagnostic(algo, "covpo/selected_frac", percent))
        cells[1:1] = [mean_std([r["evals"][k + 1][1] for r in sorted(runs, key=lambda r: r["seed"])])
                      for k in range(len(earlier))]
        lines.append("| " + " | ".join(cells) + " |")
    return head + lines


def rendered(match: re.Match) -> str:
    diff_of, algo_of, study = match.group("diff"), match.group("algo"), match.group("study")
    for group, table in PLAN_TABLES.items():  # evals/plan.py's tables, from the runs in the named folder
        if match.group(group):
            from evals import plan

            body = getattr(plan, table)(os.path.join(ROOT, match.group(group)))
            return match.group("begin") + "\n".join(body) + "\n" + match.group("end")
    if match.group("vs_study"):
        body = study_against(match.group("vs_study"), match.group("base"))
        return match.group("begin") + "\n".join(body) + "\n" + match.group("end")
    if study:
        return match.group("begin") + "\n".join(study_table(study, match.group("only"))) + "\n" + match.group("end")
    if match.group("what") == "layout common":
        body, lang = layout(match.group("body")), "text"
    elif match.group("what") == "imports common":
        body, lang = import_floors(), "text"
    else:
        body, lang = (live_diff(diff_of), "diff") if diff_of else (algo_section(algo_of), "python")
    while body and not body[-1].strip():
        body.pop()
    return match.group("begin") + f"```{lang}\n" + "\n".join(body) + "\n```\n" + match.group("end")


def pages() -> list[str]:
    return [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"),
                                                                recursive=True))]


def check() -> list[str]:
    """Every stale generated block and every excerpt line that is not in the live diff, one message each."""
    problems = []
    for path in pages():
        with open(path) as f:
            text = f.read()
        rel = os.path.relpath(path, ROOT)
        for match in BLOCK.finditer(text):
            tag = match.group("study") or match.group("vs_study")
            if tag and not os.path.exists(os.path.join(ROOT, "docs", "studies", f"{tag}.json")):
                problems.append(f"{rel}: the study '{tag}' has no docs/studies/{tag}.json")
                continue
            if match.group(0) != rendered(match):
                problems.append(f"{rel}: the block '{match.group('what')}' is stale: run python docs/make_diffs.py")
            if "UNDESCRIBED" in rendered(match):
                problems.append(f"{rel}: a module in the block '{match.group('what')}' has no description")
        for name, excerpt in EXCERPT.findall(text):
            diff = set(live_diff(name))
            for line in excerpt.splitlines():
                if line[:1] in "+-" and line not in diff:
                    problems.append(f"{rel}: excerpt line not in diff -u grpo.py {name}.py: {line}")
    return problems


def write() -> None:
    missing = [p for p in check() if "has no docs/studies/" in p]
    if missing:  # a page names a study whose file is not there yet: nothing is written
        raise SystemExit("\n".join(f"error: {p}" for p in missing))
    for path in pages():
        with open(path) as f:
            text = f.read()
        new = BLOCK.sub(rendered, text)
        if new != text:
            with open(path, "w") as f:
                f.write(new)
            print("wrote", os.path.relpath(path, ROOT))


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        found = check()
        print("\n".join(found) or "every generated block is current")
        sys.exit(1 if found else 0)
    write()
