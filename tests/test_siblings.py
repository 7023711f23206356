"""The estimator scripts (evals.ALGORITHMS) share one skeleton: `diff grpo.py X.py` shows only how the estimators
differ.

Allowed to differ: the module docstring, the `# Algorithm-specific` block of Args (the shared flags are
common/args.py's TrainArgs, which every Args extends), the `# ALGO LOGIC` section (compute_advantages, batch_stats,
compute_loss), and in main() only a few lines tagged `# <ALGO>:` that the estimator truly needs in the loop.
"""

import difflib
import glob
import importlib
import json
import os
import subprocess
import sys

import pytest
from conftest import step_files_named, subprocess_env

from evals import ALGORITHMS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_files(folder: str) -> list[str]:
    """Every .py file under REPO/folder, in its subpackages too."""
    return sorted(glob.glob(os.path.join(REPO, folder, "**", "*.py"), recursive=True))


# Max changed lines (`<` and `>`) in `diff grpo.py X.py`. grpo.py is DeepSeekMath's GRPO alone since the landscape
# paper's switches became landscape.py (2026-12-06), so no sibling spends lines deleting another paper's ablations:
# measured then gspo 49, cispo 53, luspo 54, ..., ipo 104, ctpo 107, reinforcepp 119, covpo 132, p3o 133, snib 169.
# The bounds are issue 66's: gspo 60, every other 120, but for three scripts whose own paper's method needs more:
# covpo holds two methods (Clip-Cov and KL-Cov) and their token selection over every process, p3o its ESS pre-pass,
# its scope switch and its entropy bonus, snib the paper's five ablations (Table 5), SNIB-fg's gradient through the
# group mean among them. Theirs are the measured figure plus about 5%. Wrapping the scripts to 100 columns (issue
# 66) gave lines to the objectives their docstrings write in ASCII math and to the estimators' own long lines:
# measured then gspo 54, ..., reinforcepp 123, p3o 132, covpo 139, snib 180. Two bounds were raised rather than the
# lines packed, to that figure plus about 5%: reinforcepp's four-line objective took seven, and snib's objective,
# problems() message, reward noise and per-sequence min took a line more each.
# sdpo: issue 69's bound was 150 for a second model (the self-teacher and its EMA) and the re-prompting of each row
# from its group, met at 148; its Args.problems(), which refuses a template with a field it does not fill and
# --dynamic_sampling before anything loads (they raised at the first step after the weights had loaded), took 13
# lines more: 161, and the bound 170; skipping the teacher's forward on a micro-batch with no re-prompted row, 3
# more: 164. The feedback text (TRL's privileged_context column: --feedback_column, its template and
# TRL's environment_feedback_only_without_solution, the column checked once the data loads, the text put in each
# row's re-prompt, its metric) took 21 more: 185, and the bound that plus about 5%.
BUDGET = {"gspo": 60, "covpo": 140, "p3o": 140, "reinforcepp": 129, "snib": 189, "sdpo": 195}
SIBLINGS = {name: BUDGET.get(name, 120) for name in ALGORITHMS if name != "grpo"}
MAX_MAIN_LINES = 6
# The repository files besides the script whose functions one warm toy step calls (benchmarks/step_path.py), the
# task's own reward function included: 11 before issue 66, 6 after its first part, 4 since the update's rules joined
# common/sampling.py and the toy's reward common/tasks/rewards.py.
STEP_FILES = 4
# Lines of a whole script and of its main(), blank lines and comments included: the longest measured when these were
# set (2026-11-27: covpo.py and snib.py 253, p3o.py's main 79 of which 61 are statements) plus about 10%. Issue 51
# asked for 180 and 60; reaching them would take the estimators' metrics or main's named steps out, or pack lines.
# 280 became 290 when the update's pieces joined common/sampling.py (issue 66): the scripts import its eight names
# one per line (ruff's wrapping at 100 columns), eight lines more each, and a sibling's own name is one diff line.
# 290 became 300 when every line of the scripts was wrapped to 100 columns (issue 66): snib.py 287 -> 296.
MAX_SCRIPT_LINES = 300
# sdpo.py builds its self-teacher's contexts from the batch (each row's demonstration, the re-prompt under the chat
# template, its tokens) and keeps an EMA copy of the weights: about 45 lines no other estimator has, measured
# 312 (2026-12-06, wrapped as the others), then 325 with its problems() (above), 349 with the feedback text (above);
# its bound is that plus about 5%.
LONGER = {"sdpo": 365}
# 88 became 89 with sdpo.py (2026-12-06): grpo.py's main() is 83 lines since the wrapping, and a sibling may add
# MAX_MAIN_LINES = 6 tagged lines to it; sdpo.py adds all six (its teacher, the contexts, the teacher's forward,
# its two inputs to compute_loss, the EMA).
MAX_MAIN_FUNCTION_LINES = 89


def regions(name: str) -> dict[str, list[str]]:
    with open(os.path.join(REPO, f"{name}.py")) as f:
        lines = f.read().splitlines()
    first_import = next(i for i, line in enumerate(lines) if line.startswith(("import ", "from ")))
    algo_args = lines.index("    # Algorithm-specific")
    algo_logic = next(i for i, line in enumerate(lines) if line.startswith("# ALGO LOGIC"))
    main = next(i for i, line in enumerate(lines) if line.startswith("def main("))
    # `from typing import Literal` is imported only by the scripts whose own flags take one of a few values (ruff
    # refuses an unused import), so it is the one import line that may differ
    header = [line for line in lines[first_import:algo_args] if line != "from typing import Literal"]
    return {"docstring": lines[:first_import], "imports and the Args header": header,
            "algorithm Args": lines[algo_args:algo_logic], "algo logic": lines[algo_logic:main],
            "main": lines[main:]}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_a_script_and_its_main_stay_short_enough_to_read_in_one_sitting(name):
    present(name)
    with open(os.path.join(REPO, f"{name}.py")) as f:
        lines = f.read().splitlines()
    main = lines.index("def main(args: Args):")
    end = lines.index('if __name__ == "__main__":')
    assert len(lines) <= LONGER.get(name, MAX_SCRIPT_LINES), f"{name}.py: {len(lines)} lines"
    assert end - main - 2 <= MAX_MAIN_FUNCTION_LINES, f"{name}.py main(): {end - main - 2} lines"


def present(name):
    if not os.path.exists(os.path.join(REPO, f"{name}.py")):
        pytest.fail(f"{name}.py is missing")


def changed_lines(base: list[str], other: list[str]) -> list[str]:
    """The `-` and `+` lines of the diff of two regions."""
    diff = difflib.unified_diff(base, other, lineterm="", n=0)
    return [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]


@pytest.mark.parametrize("name", sorted(SIBLINGS))
def test_diff_touches_only_the_estimator(name):
    """The imports, the Args header and main() are grpo.py's but for lines tagged `# NAME:` (an import of what
    the tagged lines of main call, at most MAX_MAIN_LINES of main)."""
    present(name)
    base, other = regions("grpo"), regions(name)
    tag = f"# {name.upper()}:"
    header = changed_lines(base["imports and the Args header"], other["imports and the Args header"])
    untagged = [line for line in header if line.startswith("+") and tag not in line]
    assert not untagged, f"the imports and the Args header differ from grpo.py's in untagged lines: {untagged}"
    changed = changed_lines(base["main"], other["main"])
    added = [line for line in changed if line.startswith("+")]
    untagged = [line for line in added if tag not in line]
    assert not untagged, f"lines of main() that differ from grpo.py must carry '{tag}': {untagged}"
    assert len(added) <= MAX_MAIN_LINES, added
    assert len(changed) - len(added) <= MAX_MAIN_LINES, changed


@pytest.mark.parametrize("name", sorted(SIBLINGS))
def test_diff_is_small(name):
    present(name)
    out = subprocess.run(["diff", os.path.join(REPO, "grpo.py"), os.path.join(REPO, f"{name}.py")],
                         capture_output=True, text=True).stdout
    changed = sum(line.startswith(("<", ">")) for line in out.splitlines())
    assert changed <= SIBLINGS[name], f"diff grpo.py {name}.py changes {changed} lines"


@pytest.mark.parametrize("name", ["grpo", *sorted(SIBLINGS)])
def test_contract_is_importable_without_side_effects(name):
    present(name)
    module = importlib.import_module(name)
    assert callable(module.compute_advantages) and callable(module.compute_loss) and callable(module.batch_stats)
    args = module.Args()
    assert args.exp_name == name and args.num_generations >= 2 and hasattr(args, "beta")


# What a user copies with grpo.py: the files of the repository a command really imports (benchmarks/copy_cost.py
# runs it and reads sys.modules). The toy's quick start; and the README's GPU command, `--model Qwen/Qwen3-4B
# --dataset gsm8k` on vLLM, stood in for by the toy's model and data files with the GPU command's reward (the math
# grader) and held-out accuracy: the same modules (a hub dataset and a local file are read by common/tasks/data.py
# alike)
# but the engine, transformers' here, with vLLM's added by name (tests/test_vllm_train.py runs it on vLLM itself).
TOY_COMMAND = ["grpo.py", "--preset", "toy", "--total_steps", "1", "--eval_steps", "1"]
GPU_STAND_IN = ["grpo.py", "--model", "runs/toy/model", "--dataset", "runs/toy/train.jsonl", "--eval_dataset",
                "runs/toy/test.jsonl", "--eval_num_prompts", "8", "--reward_funcs", "math_accuracy",
                "--prompt_template", "{prompt}", "--dtype", "float32", "--max_prompt_length", "8",
                "--max_completion_length", "6", "--batch_size", "8", "--num_generations", "4", "--total_steps", "1",
                "--eval_steps", "1", "--report_to", "none"]
# Code tokens at most (benchmarks/copy_cost.py: comments and docstrings are counted apart, so explaining costs
# nothing and packing saves nothing). Each bound is the figure measured when it was set plus about 10%, so that a
# readable change fits: set at toy 22,961 and GPU stand-in 29,610 (2026-11-27), raised the same day to 27,000 and
# 35,000 when top-p's renormalised log-probs and TRL's reward call and data formats on the default path had brought
# them to 24,769 and 31,576 (docs/layout.md has today's figures). 27,000 became 27,100 (2026-12-06) when setup()
# gave a script's problems() the training data's columns once they load, before the weights (sdpo.py refuses a
# --feedback_column the data lacks): 38 tokens past 26,963 on the quick start's path. The other places were a refusal
# after the weights load, which the rails forbid, or a check of local files only. The toy's preset then took sdpo.py's
# templates in its vocabulary (a preset's values of flags a script lacks left out): 27,050.
COPY_COST = {"toy": 27_100, "gpu": 35_000}


def copy_cost(cwd, command: list[str], python=sys.executable) -> tuple[dict, list[str]]:
    """({lines, code, prose}, files) of what `python COMMAND` imported from the repository, by
    benchmarks/copy_cost.py."""
    out = subprocess.run([python, os.path.join(REPO, "benchmarks", "copy_cost.py"), *command], cwd=cwd,
                         capture_output=True, text=True, timeout=900, env=subprocess_env())  # no MASTER_PORT of ours
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    table = out.stdout[out.stdout.rindex("imported:"):].splitlines()[2:]  # after the header line
    totals = dict(zip(("lines", "code", "prose"), map(int, table[-1].split()[:3])))
    return totals, [line.split()[3] for line in table[:-1]]


def file_cost(path: str) -> dict:
    """{lines, code, prose} of one file of the repository."""
    from benchmarks.copy_cost import lines, tokens

    code, prose = tokens(os.path.join(REPO, path))
    return {"lines": lines(os.path.join(REPO, path)), "code": code, "prose": prose}


def layout_row(command: str) -> tuple[int, ...]:
    """(files, lines, code tokens, prose words) that docs/layout.md's copy-cost table gives the command its first cell
    starts with."""
    with open(os.path.join(REPO, "docs", "layout.md")) as f:
        row = next(line for line in f if line.startswith(f"| {command}"))
    return tuple(int(cell.strip().replace(",", "")) for cell in row.strip().strip("|").split("|")[-4:])


def test_the_layouts_static_copy_cost_is_measured(capsys):
    """docs/layout.md's `--static grpo.py` row (every file an import statement reaches) is what copy_cost.py counts:
    it has no run to take, so nothing else would notice it drift."""
    from benchmarks.copy_cost import reachable_files, report

    files = reachable_files("grpo.py")
    totals = report(files)
    assert layout_row("`--static grpo.py`") == (len(files), *totals)


def test_copying_grpo_for_the_toy_takes_what_its_run_imports(in_toy_workdir):
    cost, files = copy_cost(in_toy_workdir, TOY_COMMAND + ["--run_name", "copy_cost_toy"])
    assert cost["code"] <= COPY_COST["toy"], (cost, files)
    measured = (len(files), cost["lines"], cost["code"], cost["prose"])
    assert layout_row("`grpo.py --preset toy`") == measured  # the docs' figures are the measured ones
    # the GPU path, the tool turns, the math grader, benchmarks, LoRA, resuming, recipes and sharding load only when
    # their flag is on
    optional = {"common/engines/vllm_engine.py", "common/engines/multiturn.py", "common/engines/sandbox.py",
                "common/tasks/math_grader.py", "common/tasks/benchmark_scoring.py", "common/tasks/benchmark_sets.py",
                "common/models/lora.py", "common/run_folder/resume.py", "common/rails/recipes.py",
                "common/models/sharding.py", "common/dapo.py", "common/tasks/toy_tir.py", "common/tasks/smollm2.py",
                "common/nucleus.py", "common/tasks/reward_files.py", "common/tasks/conversations.py",
                "common/rails/command_line.py"}
    assert "common/tasks/toy.py" in files and not optional & set(files), optional & set(files)


def test_copy_cost_lists_the_functions_a_run_never_called(in_toy_workdir):
    """`copy_cost.py --uncalled`: per file, the lines of the functions the run never called. The toy was built
    before the run, so its builder is among them; the rollouts' sample_batch ran, so it is not; the total is the
    files' sum."""
    env = subprocess_env()
    # a first run: datasets' cache of the prepared prompts (shared by every run of the machine) would skip their
    # formatting
    env["HF_DATASETS_CACHE"] = os.path.join(in_toy_workdir, "datasets_cache")
    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "copy_cost.py"), "--uncalled",
                          *TOY_COMMAND], cwd=in_toy_workdir, capture_output=True,
                         text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    section = out.stdout[out.stdout.rindex("uncalled"):].splitlines()[1:]
    rows = {line.split()[2].rstrip(":"): line for line in section[:-1]}
    assert "warm_start" in rows["common/tasks/toy.py"], rows["common/tasks/toy.py"]
    assert "sample_batch" not in rows["common/sampling.py"], rows["common/sampling.py"]
    total = int(section[-1].split()[0])
    assert total == sum(int(line.split()[0]) for line in section[:-1])
    # docs/layout.md's figures are these
    imported = out.stdout[out.stdout.rindex("imported:"):out.stdout.rindex("uncalled")].splitlines()
    lines = int(next(line for line in imported if "total in" in line).split()[0])
    with open(os.path.join(REPO, "docs", "layout.md")) as f:
        layout = " ".join(f.read().split())
    toy, logprobs = (int(rows[f"common/{name}"].split()[0]) for name in ("tasks/toy.py", "logprobs.py"))
    assert (f"{total} of the {lines:,}, of which the toy's builder is {toy} " in layout
            and f"not a plain linear map {logprobs}," in layout), (total, lines, toy, logprobs)


def test_copying_grpo_for_the_gpu_command_takes_what_its_run_imports(in_toy_workdir):
    cost, files = copy_cost(in_toy_workdir, GPU_STAND_IN + ["--rollout_engine", "hf", "--run_name", "copy_cost_gpu"])
    assert "common/tasks/math_grader.py" in files and "common/tasks/toy.py" not in files, files
    engine = file_cost("common/engines/vllm_engine.py")
    total = {k: cost[k] + engine[k] for k in cost}
    assert total["code"] <= COPY_COST["gpu"], (total, files)
    measured = (len(files) + 1, total["lines"], total["code"], total["prose"])
    assert layout_row("the GPU command") == measured  # the docs' figures are the measured ones


def test_grpos_header_names_the_files_one_step_calls(in_toy_workdir):
    """The files a student opens to follow one warm on-policy step of the toy (sample, reward, advantage, log-probs,
    loss, backward, optimizer step), as benchmarks/step_path.py records them under the profiler, are the files
    grpo.py's docstring names in its "One step" paragraph, and at most STEP_FILES of them."""
    out = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "step_path.py"), "grpo.py", "--json"],
                         cwd=in_toy_workdir, capture_output=True, text=True, timeout=600, env=subprocess_env())
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    path = json.loads(out.stdout.strip().splitlines()[-1])
    named = step_files_named("grpo.py")
    assert named == set(path), (sorted(named), path)
    assert len(path) <= STEP_FILES, path


def test_the_documented_copy_cost_command_runs_from_the_repository_root(monkeypatch):
    """docs/layout.md runs benchmarks/copy_cost.py from the repository's root, where torch.ops' and torch.classes'
    bare `__file__` names ("_classes.py") once resolved to files that do not exist (FileNotFoundError)."""
    from benchmarks.copy_cost import imported_files

    monkeypatch.chdir(REPO)
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # imported_files sets sys.argv, as the script's run would
    files = imported_files("grpo.py", ["--help"])
    assert os.path.join(REPO, "grpo.py") in files and os.path.join(REPO, "common", "args.py") in files
    assert all(os.path.exists(f) for f in files), files


def test_the_toy_is_imported_by_the_toy_alone():
    """No module but the TIR toy imports common/tasks/toy.py (a preset or a reward name loads it
    through a registry: common/tasks/data.py PRESET_MODULES, common/tasks/reward_names.py
    BUILT_IN_MODULES)."""
    import ast

    paths = glob.glob(os.path.join(REPO, "*.py")) + python_files("common") + python_files("evals")
    for path in [p for p in paths if os.path.basename(p) != "toy_tir.py"]:
        with open(path) as f:
            tree = ast.parse(f.read())
        names = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + \
                [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert "common.tasks.toy" not in names and "common.tasks.toy_tir" not in names, path


def load_make_diffs():
    path = os.path.join(REPO, "docs", "make_diffs.py")
    spec = importlib.util.spec_from_file_location("make_diffs", path)
    make_diffs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_diffs)
    return make_diffs


def test_common_and_evals_import_in_no_circle():
    """Following every import (inside functions too, importlib.import_module of a literal, and a
    registry's module names such as PRESET_MODULES' "common.tasks.toy"), no module of common/ or
    evals/ reaches itself."""
    imports_of = load_make_diffs().imports_of
    graph = {}
    for path in python_files("common") + python_files("evals"):
        graph[path] = {os.path.join(REPO, f) for f in imports_of(os.path.relpath(path, REPO))}
    for start in graph:
        seen, todo = set(), list(graph[start])
        while todo:
            path = todo.pop()
            assert path != start, f"{os.path.relpath(start, REPO)} imports itself through a circle"
            if path not in seen:
                seen.add(path)
                todo += graph.get(path, ())


def test_common_imports_stay_on_their_floor_or_below():
    """Issue 66: every module of common/ stands on one of docs/make_diffs.py's FLOORS and imports
    (at the top, inside a function, by importlib or through a registry's names) only modules of its
    own floor or of one below; the drawing of these imports in docs/layout.md is written from the
    same floors (tests/test_docs.py holds it)."""
    make_diffs = load_make_diffs()
    floor_of = make_diffs.floor_of
    modules = make_diffs.common_modules()
    assert len(modules) > 40, modules
    unplaced = [path for path in modules if floor_of(path) is None]
    assert not unplaced, f"place these on a floor of docs/make_diffs.py's FLOORS: {unplaced}"
    upward = [f"{path} (floor {floor_of(path) + 1}) imports {other} (floor {floor_of(other) + 1})"
              for path in modules for other in sorted(make_diffs.imports_of(path))
              if floor_of(other) > floor_of(path)]
    assert not upward, "imports up a floor:\n" + "\n".join(upward)


def test_the_floor_test_sees_an_import_up_a_floor_and_through_a_registry(tmp_path, monkeypatch):
    """The floors' checks count what they claim: an import inside a function, a registry's module
    name and importlib.import_module of a literal, each an import of common/."""
    make_diffs = load_make_diffs()
    (tmp_path / "common").mkdir()
    for name in ("low", "high", "named", "loaded"):
        (tmp_path / "common" / f"{name}.py").write_text("")
    (tmp_path / "common" / "low.py").write_text(
        "import importlib\n"
        "NAMES = {'x': 'common.named'}\n"
        "def f():\n"
        "    from common.high import g\n"
        "    importlib.import_module('common.loaded')\n")
    monkeypatch.setattr(make_diffs, "ROOT", str(tmp_path))
    from benchmarks import copy_cost

    monkeypatch.setattr(copy_cost, "REPO", str(tmp_path))
    expected = {"common/high.py", "common/named.py", "common/loaded.py"}
    assert make_diffs.imports_of("common/low.py") == expected


def test_imports_point_down():
    """common/ imports nothing from evals/ or the scripts; evals/ imports no script (at any level of a module)."""
    import ast

    scripts = set(ALGORITHMS)
    for folder, banned in [("common", scripts | {"evals"}), ("evals", scripts)]:
        for path in python_files(folder):
            name = os.path.relpath(path, os.path.join(REPO, folder))
            tree = ast.parse(open(path).read())
            imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            upward = {m for m in imported if m.split(".")[0] in banned}
            assert not upward, f"{folder}/{name} imports {sorted(upward)}"


def test_every_flag_common_reads_is_declared_in_trainargs():
    """Every `args.NAME` attribute that common/ reads is a TrainArgs field, so no script's Args carries a field
    that common/ depends on without saying so (issue 66: `args.beta` was one). common/engines/serve.py reads its
    own parser's flags."""
    import ast
    import dataclasses

    from common.args import TrainArgs

    declared = {f.name for f in dataclasses.fields(TrainArgs)} | {"problems"}  # and its method a script extends
    undeclared = set()
    for path in python_files("common"):
        if path.endswith(os.path.join("engines", "serve.py")):
            continue
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            is_args = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            if is_args and node.value.id == "args" and node.attr not in declared:
                undeclared.add(f"{os.path.relpath(path, REPO)}: args.{node.attr}")
    assert not undeclared, sorted(undeclared)
