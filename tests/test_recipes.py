"""configs/recipes/*.yaml: each parses with its script's parse_args, sets only fields of that script's Args, fits
the hardware it names, passes every check that needs no download, and says what it reproduces and how to launch
it."""

import dataclasses
import glob
import importlib
import os
import re

import pytest
import yaml

from common import args as arguments
from common.rails import checks
from common.rails.recipes import script_of  # a `# script: NAME` line, else the file name's prefix
from evals import ALGORITHMS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(REPO, "configs", "recipes", "*.yaml")))
SCRIPTS = ALGORITHMS


def sandboxed(path: str):
    """A recipe with tool turns (max_turns > 1) passes the early checks only where the code sandbox can start."""
    with open(path) as f:
        tools = (yaml.safe_load(f).get("max_turns") or 1) > 1
    return pytest.param(path, marks=[pytest.mark.sandbox] if tools else [], id=os.path.basename(path))


def header(path: str) -> str:
    with open(path) as f:
        return "".join(line for line in f if line.startswith("#"))


def test_every_paper_setting_has_a_recipe():
    names = {os.path.basename(p)[: -len(".yaml")] for p in RECIPES}
    assert {"snib_qwen3_4b", "ctpo_qwen3_4b", "ctpo_qwen3_14b"} <= names
    assert {script_of(p) for p in RECIPES} == set(SCRIPTS)
    assert {f"landscape_{v}" for v in ("grpo", "pl", "nl", "cl", "tncl")} <= names


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_parses_and_sets_only_fields_of_its_script(path):
    assert script_of(path) in SCRIPTS, f"{path}: no script {script_of(path)}.py; name it in a '# script:' line"
    args_cls = importlib.import_module(script_of(path)).Args
    with open(path) as f:
        recipe = yaml.safe_load(f)
    fields = {f.name: f for f in dataclasses.fields(args_cls)}
    assert set(recipe) <= set(fields), f"not fields of {script_of(path)}.Args: {sorted(set(recipe) - set(fields))}"
    args = arguments.parse_args(args_cls, ["--config", path])
    defaults = args_cls()
    for key, value in recipe.items():
        if isinstance(getattr(defaults, key), float):  # `1e-6` without a dot is a string to YAML
            assert isinstance(value, (int, float)), f"{key}: {value!r} is not a number; write it as 1.0e-6"
        assert getattr(args, key) == value, key


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_says_what_it_reproduces_and_how_to_launch_it(path):
    text = header(path)
    assert re.search(r"\b(table|figure|section)\b", text, re.IGNORECASE), "name the paper's table or figure"
    assert "Hardware:" in text
    launch = re.search(r"accelerate launch --config_file (\S+) (\w+)\.py --config (\S+)", text)
    assert launch, "give the launch command"
    accelerate_config, script, recipe = launch.groups()
    assert os.path.isfile(os.path.join(REPO, accelerate_config))
    assert script == script_of(path) and recipe == os.path.relpath(path, REPO)


@pytest.mark.parametrize("path", [sandboxed(p) for p in RECIPES])
def test_recipe_batch_geometry_fits_the_processes_of_its_launch_config(path):
    args = arguments.parse_args(importlib.import_module(script_of(path)).Args, ["--config", path])
    accelerate_config = re.search(r"--config_file (\S+)", header(path)).group(1)
    with open(os.path.join(REPO, accelerate_config)) as f:
        num_processes = yaml.safe_load(f)["num_processes"]
    assert num_processes % args.vllm_tensor_parallel_size == 0
    # every check that needs no download: ranges, geometry, names (the model and data are on the hub)
    offline = dataclasses.replace(args, report_to="none", rollout_engine="hf")
    assert checks.argument_problems(offline, num_processes) == []


def test_a_recipe_with_an_unknown_key_is_rejected(tmp_path):
    import snib

    recipe = tmp_path / "typo.yaml"
    recipe.write_text("learning_rate: 1.0e-5\nlearning_rat: 1.0e-5\n")
    with pytest.raises(SystemExit, match=r"typo.yaml sets \['learning_rat'\], which are not fields of Args"):
        arguments.parse_args(snib.Args, ["--config", str(recipe)])


def test_a_recipe_of_another_estimator_is_refused_in_one_line(tmp_path):
    """`grpo.py --config configs/recipes/snib_qwen3_4b.yaml` would run GRPO with SNIB's paper settings (the fields
    both share): refused, naming the right script; a copy under another name, or a `# script:` line, is a choice."""
    import grpo

    path = os.path.join(REPO, "configs", "recipes", "snib_qwen3_4b.yaml")
    with pytest.raises(SystemExit) as refused:
        arguments.parse_args(grpo.Args, ["--config", path])
    message = refused.value.code
    assert message.startswith("error: ") and "\n" not in message, message
    assert f"is a recipe of snib.py, not grpo.py: run python snib.py --config {path}" in message
    shared = {k: v for k, v in yaml.safe_load(open(path)).items() if k in grpo.Args.__dataclass_fields__}
    for name, text in [("mine.yaml", ""), ("snib_mine.yaml", "# script: grpo\n")]:
        (tmp_path / name).write_text(text + yaml.safe_dump(shared))
        assert arguments.parse_args(grpo.Args, ["--config", str(tmp_path / name)]).lora_r == 16


def test_the_command_line_overrides_a_recipe():
    import snib

    path = os.path.join(REPO, "configs", "recipes", "snib_qwen3_4b.yaml")
    args = arguments.parse_args(snib.Args, ["--config", path, "--beta", "0.5", "--reward_noise", "0.2"])
    assert (args.beta, args.reward_noise, args.lora_r) == (0.5, 0.2, 16)


# Every value a recipe sets that is not its script's default names where it comes from: a place in a paper, a file
# of the authors' released code (or a sibling recipe, which must then set the same value), or "our choice" and why.
SOURCE = re.compile(r"(?i:\b(?:section|table|figure|appendix|algorithm|eq\.))\s*(?:\d|[A-Z]\b)"
                    r"|\b[\w./-]+\.(?:sh|yaml|py)\b"
                    r"|(?i:\bour choice\b)\W+\w")


def source_comments(path: str) -> dict[str, str]:
    """{key: the comments that source it}: its inline comment and the comment lines heading its block (a run of
    non-blank lines), so one comment can source several keys. The file's header is a block of its own."""
    comments, block = {}, ""
    with open(path) as f:
        for line in f:
            if not line.strip():
                block = ""
            elif line.startswith("#"):
                block += line
            else:
                key, _, rest = line.partition(":")
                inline = rest.split(" #", 1)[1] if " #" in rest else ""
                comments[key.strip()] = block + inline
    return comments


def unsourced(path: str) -> list[str]:
    """The keys of a recipe that differ from the script's defaults and name no source."""
    defaults = importlib.import_module(script_of(path)).Args()
    with open(path) as f:
        recipe = yaml.safe_load(f)
    comments = source_comments(path)
    return [key for key, value in recipe.items()
            if value != getattr(defaults, key) and not SOURCE.search(comments.get(key, ""))]


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_every_value_that_is_not_the_default_names_its_source(path):
    assert not unsourced(path), f"give these keys a source (inline or heading their block): {unsourced(path)}"
    with open(path) as f:
        recipe = yaml.safe_load(f)
    for key, comment in source_comments(path).items():  # "as <sibling>.yaml" must hold
        for name in re.findall(r"\b(\w+)\.yaml\b", comment):
            sibling = os.path.join(REPO, "configs", "recipes", f"{name}.yaml")
            if os.path.isfile(sibling) and sibling != path:
                with open(sibling) as f:
                    assert yaml.safe_load(f).get(key) == recipe[key], f"{key}: cites {name}.yaml, which differs"


def test_the_source_check_catches_an_unsourced_value(tmp_path):
    recipe = tmp_path / "grpo_check.yaml"
    recipe.write_text("# header: Table 1\n\nlearning_rate: 1.0e-5\nbeta: 0.1              # Table 1(b)\n"
                      "# our choice: short runs\ntotal_steps: 10\nseed: 1\n\nepsilon: 0.3  # our choice\n"
                      "epsilon_high: 0.2\n")
    # learning_rate: no comment (the header is not its block); seed and epsilon_high: the defaults;
    # epsilon: "our choice" without a reason
    assert unsourced(str(recipe)) == ["learning_rate", "epsilon"]


@pytest.mark.parametrize("name", ["ctpo_qwen3_4b", "ctpo_qwen3_14b", "ctpo_qwen3_14b_fixed_clip"])
def test_ctpo_recipes_train_in_the_tool_integrated_setting(name):
    """CTPO's section 4.1: SimpleTIR's prompt, up to 5 turns, 8000 tokens per trajectory, sequence-level IS at 5."""
    from common.engines.multiturn import TIR_PROMPT_TEMPLATE

    with open(os.path.join(REPO, "configs", "recipes", f"{name}.yaml")) as f:
        recipe = yaml.safe_load(f)
    assert recipe["prompt_template"] == TIR_PROMPT_TEMPLATE
    assert (recipe["max_turns"], recipe["tool"], recipe["max_completion_length"]) == (5, "simpletir", 8000)
    assert (recipe["tis_cap"], recipe["tis_mode"]) == (5.0, "sequence")
