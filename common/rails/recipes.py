"""--config FILE.yaml: a recipe, read, matched to its script and type-checked (imported only when a
recipe is given)."""

import os
import re
import types
import typing

import yaml


def read_recipe(path: str) -> dict:
    """A --config YAML file: a mapping of field names to values, or a one-line error naming the
    file."""
    try:
        with open(path) as f:
            recipe = yaml.safe_load(f)
    except OSError as e:
        raise SystemExit(f"error: --config {path!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise SystemExit(f"error: --config {path!r} is not valid YAML{line}: "
                         f"{getattr(e, 'problem', e)}") from None
    if recipe is not None and not isinstance(recipe, dict):
        raise SystemExit(f"error: --config {path!r} must be a mapping of Args fields (name: "
                         f"value), not a {type(recipe).__name__}")
    return recipe or {}


def script_of(path: str) -> str | None:
    """The estimator a recipe is for: a `# script: NAME` line, else the file name's prefix when it
    names a script of the repository (configs/recipes/snib_qwen3_4b.yaml -> snib); None for a recipe
    of no script (my_run.yaml)."""
    with open(path) as f:
        named = re.search(r"^# script: (\w+)", f.read(), re.MULTILINE)
    prefix = os.path.basename(path).split("_")[0]
    # the repository's root, two folders above common/rails/
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    if named:
        return named.group(1)
    return prefix if os.path.isfile(os.path.join(root, f"{prefix}.py")) else None


def script_problem(path: str, script: str | None) -> str | None:
    """A recipe of another estimator would run this one with another paper's settings: refused,
    naming the fix. `script`: the running script's name (its Args' exp_name; None for Args of no
    estimator, such as evals.run's)."""
    owner = script_of(path)
    if script is None or owner is None or owner == script:
        return None
    return (f"error: --config {path} is a recipe of {owner}.py, not {script}.py: run python "
            f"{owner}.py --config {path}; to use its settings with {script}.py, copy it under a "
            f"name that does not start with '{owner}_' (or add a line '# script: {script}')")


def type_problems(args, recipe: dict, config: str | None) -> list[str]:
    """Values whose type is not the field's: argparse converts only strings, so a YAML list, float
    or mapping reaches the dataclass as it is (and a Literal's choices are not checked on
    defaults)."""
    problems = []
    for name, kind in typing.get_type_hints(type(args)).items():
        value = getattr(args, name)
        if not _is_instance(value, kind):
            source = f" (from {config})" if config and name in recipe else ""
            hint = (f"; write it as one comma-separated string, e.g. {','.join(map(str, value))}"
                    if isinstance(value, list) else "")
            problems.append(f"--{name} must be {_describe_type(kind)}, got {type(value).__name__} "
                            f"{value!r}{source}{hint}")
    return problems


def _is_instance(value, kind) -> bool:
    origin = typing.get_origin(kind)
    options = typing.get_args(kind)
    if origin is typing.Literal:
        return value in options
    if origin in (typing.Union, types.UnionType):
        return any(_is_instance(value, option) for option in options)
    if kind is type(None):
        return value is None
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _describe_type(kind) -> str:
    origin = typing.get_origin(kind)
    options = typing.get_args(kind)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, options))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe_type(option) for option in options)
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false",
            type(None): "null"}.get(kind, getattr(kind, "__name__", str(kind)))
