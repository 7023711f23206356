"""The estimator scripts (evals.ALGORITHMS, ten today) share one skeleton: `diff grpo.py X.py` shows only how the
estimators differ.

Allowed to differ: the module docstring, the `# Algorithm-specific` block of Args, the
`# ALGO LOGIC` section (compute_advantages, batch_stats, compute_loss), and in main() only a few
lines tagged `# <ALGO>:` that the estimator truly needs in the loop.
"""

import difflib
import importlib
import os
import subprocess

import pytest

from evals import ALGORITHMS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Max changed lines (`<` and `>`) in `diff grpo.py X.py`: 110 for every script the project holds (evals.ALGORITHMS),
# gspo 60; snib over it (SNIB-fg, its reward noise, removed rows leaving the group mean).
BUDGET = {"gspo": 60, "snib": 117}
SIBLINGS = {name: BUDGET.get(name, 110) for name in ALGORITHMS if name != "grpo"}
MAX_MAIN_LINES = 6


def regions(name: str) -> dict[str, list[str]]:
    with open(os.path.join(REPO, f"{name}.py")) as f:
        lines = f.read().splitlines()
    first_import = next(i for i, line in enumerate(lines) if line.startswith(("import ", "from ")))
    algo_args = lines.index("    # Algorithm-specific")
    algo_logic = next(i for i, line in enumerate(lines) if line.startswith("# ALGO LOGIC"))
    main = next(i for i, line in enumerate(lines) if line.startswith("def main("))
    return {"docstring": lines[:first_import], "imports and shared Args": lines[first_import:algo_args],
            "algorithm Args": lines[algo_args:algo_logic], "algo logic": lines[algo_logic:main],
            "main": lines[main:]}


def present(name):
    if not os.path.exists(os.path.join(REPO, f"{name}.py")):
        pytest.fail(f"{name}.py is missing")


@pytest.mark.parametrize("name", sorted(SIBLINGS))
def test_diff_touches_only_the_estimator(name):
    present(name)
    base, other = regions("grpo"), regions(name)
    assert other["imports and shared Args"] == base["imports and shared Args"], \
        "imports and shared Args fields must be byte-identical to grpo.py"
    changed = [line for line in difflib.unified_diff(base["main"], other["main"], lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    tag = f"# {name.upper()}:"
    untagged = [line for line in changed if line.startswith("+") and tag not in line]
    assert not untagged, f"lines of main() that differ from grpo.py must carry '{tag}': {untagged}"
    assert len(changed) <= MAX_MAIN_LINES, changed


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


def test_copying_grpo_takes_at_most_2570_lines_and_no_optional_feature():
    """grpo.py and the modules it imports at module level (benchmarks/copy_cost.py): the default path only; vLLM, the
    toy, tool rollouts and the sandbox, the math grader, evaluation, LoRA, resuming, recipes and sharding load when
    their flag is on."""
    from benchmarks.copy_cost import copied_files

    files = [os.path.relpath(f, REPO) for f in copied_files("grpo.py")]
    # 2,500 until one-line argument errors, a --help with a description, --config and the --no_* flags' own words,
    # prompt masks from lengths (2,517) and a time limit on reward calls (2,563); issue 41 replaces this count with
    # what a run really imports
    assert sum(sum(1 for _ in open(os.path.join(REPO, f))) for f in files) <= 2570, files
    optional = {"common/vllm_engine.py", "common/toy.py", "common/multiturn.py", "common/sandbox.py",
                "common/math_grader.py", "common/evaluation.py", "common/benchmarks.py", "common/lora.py",
                "common/resume.py", "common/recipes.py", "common/sharding.py", "common/dapo.py"}
    assert not optional & set(files), optional & set(files)


def test_imports_point_down():
    """common/ imports nothing from evals/ or the scripts; evals/ imports no script (at any level of a module)."""
    import ast

    scripts = set(ALGORITHMS)
    for folder, banned in [("common", scripts | {"evals"}), ("evals", scripts)]:
        for name in sorted(os.listdir(os.path.join(REPO, folder))):
            if not name.endswith(".py"):
                continue
            tree = ast.parse(open(os.path.join(REPO, folder, name)).read())
            imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
            upward = {m for m in imported if m.split(".")[0] in banned}
            assert not upward, f"{folder}/{name} imports {sorted(upward)}"
