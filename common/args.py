"""Arguments: a script's `Args` fields (`arg`), --preset defaults, and the parser (`parse_args`), which reads a
--config recipe (common/recipes.py) under the command line."""

import argparse
import copy
import dataclasses
import difflib
import importlib
import os
import re
import sys
import types

from transformers import HfArgumentParser

# --preset NAME: the module holding its defaults (PRESETS) and building what it reads (prepare_preset), imported only
# when the preset is asked for: the toys' common/toy.py, the real model's common/models.py
PRESET_MODULES = {"toy": "common.toy", "toy_tir": "common.toy_tir", "smollm2": "common.models"}
PRESET_NAMES = tuple(PRESET_MODULES)


def preset_defaults(preset: str | None) -> dict:
    """The defaults a --preset sets (none without one)."""
    return {} if preset is None else importlib.import_module(PRESET_MODULES[preset]).PRESETS[preset]


def arg(default, help: str, at_least: float | None = None):
    """A field of a script's `Args` dataclass with its --help line; `at_least`: the smallest value the estimator
    accepts, checked before anything loads (common/checks.py). Parse with `parse_args` (`ArgParser`)."""
    metadata = {"help": help} if at_least is None else {"help": help, "at_least": at_least}
    return dataclasses.field(default=default, metadata=metadata)


class ArgParser(HfArgumentParser):
    """HfArgumentParser, which passes a field's metadata to argparse, less the keys that are not argparse's; a bad
    value is one line naming the flag, what it got and what it takes (argparse's own prints the whole usage)."""

    def error(self, message: str):
        message = re.sub(r"(--\w+)/--[\w-]+", r"\1", message)  # "--total_steps/--total-steps": the flag as written
        raise SystemExit(f"error: {message}; --help lists the flags")

    @staticmethod
    def _parse_dataclass_field(parser, field: dataclasses.Field):
        if "at_least" in field.metadata:
            field = copy.copy(field)
            field.metadata = types.MappingProxyType({k: v for k, v in field.metadata.items() if k != "at_least"})
        HfArgumentParser._parse_dataclass_field(parser, field)
        for action in parser._actions:  # %(default).0s: no "(default: ...)" added where it would mislead or repeat
            if f"--no_{field.name}" in action.option_strings:  # the `--no_X` twin of a flag on by default
                action.help = f"turn --{field.name} off%(default).0s"
            elif f"--{field.name}" in action.option_strings and "default" in (action.help or ""):
                action.help += "%(default).0s"  # its help already says what the default is


def parse_args(args_cls, argv: list[str] | None = None):
    """HfArgumentParser with two layers of defaults under the command line: --preset NAME, then --config FILE.yaml."""
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--preset")
    known, _ = pre.parse_known_args(argv)
    recipe = {}
    if known.config is not None:
        from common.recipes import read_recipe, script_problem

        recipe = read_recipe(known.config)
        if problem := script_problem(known.config, getattr(args_cls, "exp_name", None)):  # another estimator's?
            raise SystemExit(problem)
        fields = {f.name for f in dataclasses.fields(args_cls)}
        unknown = sorted(set(recipe) - fields)
        if unknown:
            raise SystemExit(f"error: {known.config} sets {unknown}, which are not fields of {args_cls.__name__}")
    preset = recipe.get("preset") if known.preset is None else known.preset  # a recipe's preset: its defaults too
    if preset is not None and preset not in PRESET_NAMES:
        raise SystemExit(f"error: unknown --preset {preset!r}; choose one of {sorted(PRESET_NAMES)}")
    defaults = {**preset_defaults(preset), **recipe}  # the command line wins over --config, which wins over --preset
    script = sys.modules.get(args_cls.__module__)
    parser = ArgParser(args_cls, description=((script.__doc__ or "").strip().splitlines() or [None])[0],
                       epilog="Each flag is a field of the script's Args; the command line wins over --config, which "
                              "wins over --preset.")
    parser.add_argument("--config", default=argparse.SUPPRESS,  # read above; listed here for --help only
                        help="a YAML recipe of Args fields (configs/recipes/; docs/replicating.md)")
    parser.set_defaults(**defaults)
    i = argv.index("--config") if "--config" in argv else None
    rest = argv if i is None else argv[:i] + argv[i + 2 :]
    args, unknown = parser.parse_args_into_dataclasses(args=[a for a in rest if not a.startswith("--config=")],
                                                       return_remaining_strings=True)
    if unknown:
        raise SystemExit(f"error: unknown arguments {' '.join(unknown)}{did_you_mean(unknown, args_cls)}; "
                         f"--help lists the flags")
    if recipe:  # argparse checked the command line's values; a YAML file's reach the dataclass as they are
        from common.recipes import type_problems

        problems = type_problems(args, recipe, known.config)
        if problems:
            raise SystemExit("\n".join(f"error: {p}" for p in problems))
    return args


def did_you_mean(unknown: list[str], args_cls) -> str:
    flags = [f"--{f.name}" for f in dataclasses.fields(args_cls)]
    close = [m for u in unknown if u.startswith("--") for m in difflib.get_close_matches(u.split("=")[0], flags, 1)]
    return f" (did you mean {', '.join(close)}?)" if close else ""


def warn(message: str) -> None:
    """One line on stderr from the first process of each machine (the others would repeat it)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"warning: {message}", file=sys.stderr, flush=True)
