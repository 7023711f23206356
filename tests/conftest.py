"""Shared fixtures: the toy model and data, built once per test session in a temporary folder."""

import json
import os

import pytest
from accelerate.state import AcceleratorState, GradientState, PartialState

from common.toy import TOY_DIR, prepare_toy


@pytest.fixture(scope="session")
def toy_workdir(tmp_path_factory):
    """A working directory holding runs/toy (the scripts find the toy preset there)."""
    workdir = tmp_path_factory.mktemp("work")
    prepare_toy(str(workdir / TOY_DIR))
    return workdir


@pytest.fixture
def in_toy_workdir(toy_workdir, monkeypatch):
    monkeypatch.chdir(toy_workdir)
    return toy_workdir


def run_script(module, argv: list[str]) -> str:
    """Run `module.main` in this process, as `python script.py ARGV` would; returns the run folder."""
    from common.utils import parse_args

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()
    return module.main(parse_args(module.Args, argv))


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]
