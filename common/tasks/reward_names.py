"""Reward functions by name (``--reward_funcs``): a registered name, an import path
``"package.module:function"`` or a file ``"path/to/file.py:function"``.

The built-in graders (``math_accuracy``, ``choice_accuracy``, ``format``, the toys' and SmolLM2's)
register themselves in common/tasks/rewards.py when their module is imported, and it is imported the
first time one of its names is asked for: a run with other rewards does not load it (the toy's
``toy_addition`` is rewards.py's own). This module stands above both, so a grader imports
rewards.py and nothing imports back.
"""

import importlib

from common.tasks.rewards import REWARD_FUNCTIONS, RewardFn

# Registered names whose module is imported when they are first asked for
# (common/tasks/math_grader.py is 800 lines).
BUILT_IN_MODULES = {**{name: "common.tasks.math_grader" for name in ("math_accuracy", "format")},
                    "choice_accuracy": "common.tasks.choice_grader",
                    "toy_closeness": "common.tasks.toy",
                    "toy_tir_addition": "common.tasks.toy_tir",
                    "number_accuracy": "common.tasks.smollm2"}


def get_reward_function(name: str) -> RewardFn:
    """A registered reward function, or one given by its import path ``"package.module:function"``
    or by its file ``"path/to/file.py:function"``."""
    if name not in REWARD_FUNCTIONS and name in BUILT_IN_MODULES:
        importlib.import_module(BUILT_IN_MODULES[name])  # registers it
    if name in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name]
    if ":" in name:  # common/tasks/reward_files.py, imported only then
        from common.tasks.reward_files import import_reward

        return import_reward(name)
    if name.endswith(".py") or "/" in name:
        raise ValueError(f"reward function {name!r} names a file but no function in it; "
                         f"give both, e.g. {name}:my_function")
    raise ValueError(
        f"unknown reward function {name!r}; registered: {sorted(REWARD_FUNCTIONS)}, "
        "or give an import path 'package.module:function' or a file 'path/to/file.py:function'"
    )
