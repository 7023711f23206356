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

from common import checks, utils

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = sorted(glob.glob(os.path.join(REPO, "configs", "recipes", "*.yaml")))
SCRIPTS = ("grpo", "gspo", "snib", "ctpo", "p3o")


def script_of(path: str) -> str:
    """The script a recipe is for: a `# script: NAME` line, else the file name's prefix (snib_qwen3_4b -> snib)."""
    with open(path) as f:
        named = re.search(r"^# script: (\w+)", f.read(), re.MULTILINE)
    return named.group(1) if named else os.path.basename(path).split("_")[0]


def header(path: str) -> str:
    with open(path) as f:
        return "".join(line for line in f if line.startswith("#"))


def test_every_paper_setting_has_a_recipe():
    names = {os.path.basename(p)[: -len(".yaml")] for p in RECIPES}
    assert {"snib_qwen3_4b", "ctpo_qwen3_4b", "ctpo_qwen3_14b"} <= names
    assert {script_of(p) for p in RECIPES} == set(SCRIPTS)
    assert {f"grpo_landscape_{v}" for v in ("grpo", "pl", "nl", "cl", "tncl")} <= names


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_parses_and_sets_only_fields_of_its_script(path):
    assert script_of(path) in SCRIPTS, f"{path}: no script {script_of(path)}.py; name it in a '# script:' line"
    args_cls = importlib.import_module(script_of(path)).Args
    with open(path) as f:
        recipe = yaml.safe_load(f)
    fields = {f.name: f for f in dataclasses.fields(args_cls)}
    assert set(recipe) <= set(fields), f"not fields of {script_of(path)}.Args: {sorted(set(recipe) - set(fields))}"
    args = utils.parse_args(args_cls, ["--config", path])
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


@pytest.mark.parametrize("path", RECIPES, ids=os.path.basename)
def test_recipe_batch_geometry_fits_the_processes_of_its_launch_config(path):
    args = utils.parse_args(importlib.import_module(script_of(path)).Args, ["--config", path])
    accelerate_config = re.search(r"--config_file (\S+)", header(path)).group(1)
    with open(os.path.join(REPO, accelerate_config)) as f:
        num_processes = yaml.safe_load(f)["num_processes"]
    assert num_processes % args.vllm_tensor_parallel_size == 0
    # every check that needs no download: ranges, geometry, names (the model and data are on the hub)
    assert checks.argument_problems(dataclasses.replace(args, report_to="none", rollout_engine="hf"), num_processes) == []


def test_a_recipe_with_an_unknown_key_is_rejected(tmp_path):
    import snib

    recipe = tmp_path / "typo.yaml"
    recipe.write_text("learning_rate: 1.0e-5\nlearning_rat: 1.0e-5\n")
    with pytest.raises(SystemExit, match=r"typo.yaml sets \['learning_rat'\], which are not fields of Args"):
        utils.parse_args(snib.Args, ["--config", str(recipe)])


def test_the_command_line_overrides_a_recipe():
    import snib

    path = os.path.join(REPO, "configs", "recipes", "snib_qwen3_4b.yaml")
    args = utils.parse_args(snib.Args, ["--config", path, "--beta", "0.5", "--reward_noise", "0.2"])
    assert (args.beta, args.reward_noise, args.lora_r) == (0.5, 0.2, 16)
