"""Reward functions named by their import path, ``package.module:function``, or by their file,
``path/to/my_rewards.py:function`` (common/tasks/reward_names.py get_reward_function; imported only
for such names)."""

import importlib
import importlib.util
import os
import sys


def is_file_path(module: str) -> bool:
    """`module` names a Python file (``path/to/my_rewards.py``), not an import path."""
    return module.endswith(".py") or "/" in module or os.sep in module


# the files loaded by path, by absolute path: loaded once, whoever asks again
_FILE_MODULES: dict = {}


def load_file(path: str):
    """The module of the Python file at `path`, executed once. Its folder is appended to sys.path,
    so that it can import the modules beside it."""
    full = os.path.abspath(os.path.expanduser(path))
    if full in _FILE_MODULES:
        return _FILE_MODULES[full]
    if not os.path.isfile(full):
        raise ImportError(f"no such file: {path}")
    stem = os.path.splitext(os.path.basename(full))[0]
    # its own name where free (tracebacks and pickling read it), else a name of its own
    module_name = stem if stem not in sys.modules else f"reward_file_{abs(hash(full))}"
    spec = importlib.util.spec_from_file_location(module_name, full)
    module = importlib.util.module_from_spec(spec)
    if os.path.dirname(full) not in sys.path:
        sys.path.append(os.path.dirname(full))
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    _FILE_MODULES[full] = module
    return module


def import_reward(name: str):
    """The function `name` names: ``module:function`` or ``path/to/file.py:function``; a
    ValueError says why not, and names the fix where the module is not found."""
    # a file's path may hold a colon itself: the function's name follows the last
    module_name, _, attr = name.rpartition(":")
    try:
        module = (load_file(module_name) if is_file_path(module_name)
                  else importlib.import_module(module_name))
        fn = getattr(module, attr)
    except ModuleNotFoundError as e:
        hint = ""
        if e.name == module_name.split(".")[0]:  # the module itself, not one it imports
            hint = (f" (Python looks in the script's folder and on PYTHONPATH); give its file "
                    f"instead, e.g. path/to/{module_name.split('.')[-1]}.py:{attr}, or add "
                    f"its folder to PYTHONPATH")
        raise ValueError(f"cannot import reward function {name!r}: {e}{hint}") from e
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import reward function {name!r}: {e}") from e
    if not callable(fn):
        raise ValueError(f"{name!r} is not callable")
    return fn
