"""Reward functions for RL post-training, and the code that calls them safely (docs/usage.md,
"Rewards").

The contract: a reward function is any plain callable that takes a batch of B prompts, the B sampled
completions (decoded text, without the prompt) and every other dataset column as a keyword list of
length B (e.g. ``answer=[...]``), and returns B finite floats. Two ways of writing one work
(``call_style``): TRL's, ``def f(completions, **kwargs)``, called by keyword as TRL's GRPOTrainer
calls it (``prompts=``, ``completions=``, ``completion_ids=`` the completions' token ids,
``trainer_state=`` an object whose ``global_step`` is the number of RL steps done before this
batch's, and the columns); and this project's, ``def f(prompts, completions, **columns)``, called
positionally where its parameters are not named so. Take ``**_`` (or ``**kwargs``) so that columns
you do not use are ignored; a function without it gets only the keywords it names. Keep it pure and
deterministic: the trainer may call it again on single samples to find a bad one (see
``compute_rewards``). To log per-sample diagnostics next to the reward, return a ``Rewards`` (a list
with a ``metrics`` dict of B values per key): each key appears in ``compute_rewards``' per-function
values as ``"<name>/<key>"``.

Adding one: decorate it with ``@register_reward("my_name")`` in any module that gets imported and
select it by that name, or select it by its import path, ``"my_package.my_module:my_function"``, or
by its file, ``"path/to/my_rewards.py:my_function"`` (common/tasks/reward_names.py, which finds
a function by its name and stands above the modules that register one here).
"""

import inspect
import math
import queue
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

RewardFn = Callable[..., Sequence[float]]
MAX_REWARD = 1e15  # larger rewards make a group's std overflow in float32 (inf, then NaN losses)


class Rewards(list):
    """A reward function's B rewards, plus per-sample diagnostics to log: ``metrics = {key: B
    floats}``."""

    def __init__(self, values, metrics: dict[str, list[float]] | None = None):
        super().__init__(values)
        self.metrics = metrics or {}


# ---------------------------------------------------------------------------
# Built-in reward functions and the registry
# ---------------------------------------------------------------------------

REWARD_FUNCTIONS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator that makes a reward function selectable by ``name``. Registering a name again
    replaces the old entry: a script that is both run as ``__main__`` and imported registers its
    functions twice, and that is fine."""

    def decorator(fn: RewardFn) -> RewardFn:
        REWARD_FUNCTIONS[name] = fn
        return fn

    return decorator


class TrainerState:
    """What a reward function that takes ``trainer_state`` gets (TRL passes its TrainerState):
    ``global_step``, the number of RL steps done before the step this batch trains."""

    def __init__(self, global_step: int):
        self.global_step = global_step

    def __repr__(self) -> str:
        return f"TrainerState(global_step={self.global_step})"


EXPECTED_SIGNATURES = ("TRL's def f(completions, **kwargs) (called with prompts=, completions=, "
                       "completion_ids=, trainer_state= and the data set's columns by name) or "
                       "def f(prompts, completions, **columns)")


def call_style(fn: RewardFn, name: str | None = None) -> str:
    """How `fn` is called: "keyword" where it has a parameter ``completions`` (TRL's functions, and
    this project's built-ins): everything by name; "positional" where it takes two positional
    arguments under other names, or has no signature to read: ``fn(prompts, completions,
    **columns)``. Any other signature raises ValueError naming the two that work."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # some built-in callables: called as they always were
        return "positional"
    kinds = inspect.Parameter
    completions = params.get("completions")
    if completions is not None and completions.kind in (kinds.POSITIONAL_OR_KEYWORD,
                                                        kinds.KEYWORD_ONLY):
        return "keyword"
    positional = [p for p in params.values()
                  if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 2 or any(p.kind == kinds.VAR_POSITIONAL for p in params.values()):
        return "positional"
    name = name or _reward_name(fn)
    raise ValueError(f"reward function {name!r} takes {inspect.signature(fn)}; write it as "
                     f"{EXPECTED_SIGNATURES}")


def call_reward_function(fn: RewardFn, prompts: list, completions: list, columns: dict,
                         extras: dict | None = None):
    """`fn` called in its style (``call_style``): by keyword with `extras` (``completion_ids``,
    ``trainer_state``) too, only the names it takes where it has no ``**kwargs``; or
    positionally."""
    if call_style(fn) == "positional":
        return fn(prompts, completions, **columns)
    kwargs = {**columns, **(extras or {}), "prompts": prompts, "completions": completions}
    params = inspect.signature(fn).parameters
    if not any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}
    return fn(**kwargs)


# ---------------------------------------------------------------------------
# Calling reward functions
# ---------------------------------------------------------------------------


class RewardError(RuntimeError):
    """A reward function raised or returned something unusable; the message shows the sample."""


def _reward_name(fn: RewardFn) -> str:
    """The registry name when the function is registered (it is what configs use), else
    ``__name__``."""
    for name, registered in REWARD_FUNCTIONS.items():
        if registered is fn:
            return name
    return getattr(fn, "__name__", type(fn).__name__)


def _clip(text, limit: int = 200) -> str:
    text = text if isinstance(text, str) else str(text)  # a conversation: its messages
    return repr(text if len(text) <= limit else text[:limit] + f"... [{len(text)} chars]")


def _describe(name: str, problem: str, i: int, prompts: list[str], completions: list[str]) -> str:
    return (
        f"reward function {name!r} {problem} at sample {i}:\n"
        f"  prompt: {_clip(prompts[i])}\n  completion: {_clip(completions[i])}"
    )


def _first_failing_sample(fn: RewardFn, prompts: list[str], completions: list[str],
                          columns: dict, extras: dict | None = None) -> int | None:
    """Index of the first sample on which ``fn`` raises when called alone, or None if none does."""
    extras = extras or {}
    for i in range(len(completions)):
        alone = {k: [v[i]] if k == "completion_ids" else v for k, v in extras.items()}
        try:
            call_reward_function(fn, [prompts[i]], [completions[i]],
                                 {k: [v[i]] for k, v in columns.items()}, alone)
        except Exception:
            return i
    return None


# reward calls under a time limit, run in turn on one long-lived daemon thread
_CALLS: "queue.Queue | None" = None


def _serve_calls() -> None:
    while True:
        call, box, done = _CALLS.get()
        try:
            box["out"] = call()
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller's thread)
            box["error"] = e
        done.set()


def within(seconds: float | None, name: str, call: Callable):
    """`call()`, waited for at most `seconds` (None: no limit): a call that never returns (a grading
    service that hangs) raises RewardError here instead of hanging the run. Calls run on one daemon
    thread that lives as long as the process: a hung call cannot be stopped and ends with the
    process, and the math grader's worker processes, which die with the thread that started them
    (PR_SET_PDEATHSIG), keep running between calls (with a thread per call they died after each, and
    the next call's correct answers scored 0)."""
    global _CALLS
    if seconds is None:
        return call()
    if _CALLS is None:
        _CALLS = queue.Queue()
        threading.Thread(target=_serve_calls, name="reward calls", daemon=True).start()
    box = {}
    done = threading.Event()
    _CALLS.put((call, box, done))
    if not done.wait(seconds):
        raise RewardError(f"reward function {name!r} did not return within {seconds:g} s "
                          f"(--reward_timeout): it hangs, or it needs a higher --reward_timeout")
    if "error" in box:
        raise box["error"]
    return box["out"]


def _call_reward(
    fn: RewardFn, name: str, prompts: list[str], completions: list[str], columns: dict[str, list],
    timeout: float | None = None, extras: dict | None = None,
) -> "tuple[torch.Tensor, dict[str, torch.Tensor]]":
    """Call one reward function and check its output, raising RewardError with the culprit sample.

    Returns the (B,) rewards and the (B,) values of each of its ``Rewards.metrics``.
    """
    import torch  # here, not at the top: grading workers import this module and must start fast
    try:
        call_style(fn, name)
    except ValueError as e:
        raise RewardError(str(e)) from None
    try:
        out = within(timeout, name,
                     lambda: call_reward_function(fn, prompts, completions, columns, extras))
    except RewardError:
        raise
    except Exception as e:
        i = _first_failing_sample(fn, prompts, completions, columns, extras)
        if i is not None:
            where = _describe(name, f"raised {type(e).__name__}: {e}", i, prompts, completions)
        else:
            where = (f"reward function {name!r} raised {type(e).__name__}: {e} "
                     f"(no single sample fails alone)")
        raise RewardError(where) from e
    if isinstance(out, (str, bytes)) or not hasattr(out, "__len__"):
        raise RewardError(f"reward function {name!r} returned "
                          f"{type(out).__name__}, expected a list of floats")
    if len(out) != len(completions):
        raise RewardError(f"reward function {name!r} returned {len(out)} rewards for "
                          f"{len(completions)} completions")
    values = []
    for i, v in enumerate(out):
        if v is None:  # TRL's convention: this function does not apply to this sample
            values.append(math.nan)
            continue
        try:
            v = float(v)
        except (TypeError, ValueError):
            raise RewardError(
                _describe(name, f"returned non-number {v!r}", i, prompts, completions)) from None
        # beyond it, float32 statistics (a group's std) overflow
        if not math.isfinite(v) or abs(v) > MAX_REWARD:
            bound = f" (rewards must stay within +-{MAX_REWARD:g})" if math.isfinite(v) else ""
            raise RewardError(_describe(name, f"returned {v}{bound}", i, prompts, completions))
        values.append(v)
    metrics = getattr(out, "metrics", {})
    for key, diagnostics in metrics.items():
        if len(diagnostics) != len(completions):
            raise RewardError(f"reward function {name!r} returned {len(diagnostics)} values of "
                              f"metric {key!r} for {len(completions)} completions")
    rewards = torch.tensor(values, dtype=torch.float32)
    metric_values = {key: torch.tensor([float(d) for d in diagnostics], dtype=torch.float32)
                     for key, diagnostics in metrics.items()}
    return rewards, metric_values


def conversational_completions(prompts: list, completions: list) -> list:
    """The completions as TRL's GRPOTrainer passes them: where the prompts are conversations (lists
    of messages), each completion as a list holding its one assistant message; else the text."""
    if not prompts or isinstance(prompts[0], str) or not isinstance(completions[0], str):
        return completions
    return [[{"role": "assistant", "content": c}] for c in completions]


def texts_of(items: list) -> list[str]:
    """The text of each prompt or completion: itself, or, in TRL's conversational form (a list of
    messages), its messages' contents, one per line. The built-in graders read through it."""
    return [x if isinstance(x, str) else "\n".join(m["content"] for m in x) for x in items]


@register_reward("toy_addition")
def toy_addition(prompts: list[str], completions: list, answer: list[str], **_) -> list[float]:
    """The toy's reward (common/tasks/toy.py), here beside the code that calls it so that the quick
    start's rewards read in one file: 1.0 for the exact sum (the completion text before EOS, spaces
    ignored), else 0.0."""
    completions = texts_of(completions)  # text, or TRL's conversational form
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]


def compute_rewards(
    funcs: list[RewardFn],
    weights: list[float] | None,
    prompts: list[str],
    completions: list[str],
    columns: dict[str, list],
    timeout: float | None = None,
    completion_ids: list[list[int]] | None = None,
    step: int | None = None,
) -> "tuple[torch.Tensor, dict[str, torch.Tensor]]":
    """Total reward per completion and each function's unweighted rewards (for logging); each
    function's call may take `timeout` seconds at most (None: no limit), or a RewardError says which
    one hung. TRL-style functions also get `completion_ids` and ``trainer_state`` (its
    ``global_step``: `step`, the RL steps done before this batch's), where given.

    A function may return None for a sample it does not apply to (TRL's convention, e.g. one reward
    per task of a mixed data set): its value there is NaN in the per-function values and leaves the
    sum; a sample no function scores is a RewardError.

    Returns ``(sum_k weights[k] * funcs[k](...), {name: (B,) tensor})``; a function that returns
    ``Rewards`` adds ``{f"{name}/{key}": (B,) tensor}`` for each of its metrics (math_accuracy:
    ``"math_accuracy/timeouts"``, 1.0 where grading ran over its time limit). A broken reward would
    silently poison the advantages, so any exception, wrong length or non-finite value stops
    training with a RewardError naming the function and sample."""
    weights = [1.0] * len(funcs) if weights is None else list(weights)
    # conversational data: each completion as its assistant message, as TRL passes it
    completions = conversational_completions(prompts, completions)
    if len(weights) != len(funcs):
        raise ValueError(f"got {len(funcs)} reward functions but {len(weights)} weights")
    for key, values in {"prompts": prompts, **columns}.items():
        if len(values) != len(completions):
            raise ValueError(
                f"{key!r} has {len(values)} entries for {len(completions)} completions")
    import torch  # see _call_reward

    extras = {}
    if completion_ids is not None:
        extras["completion_ids"] = [ids.tolist() if hasattr(ids, "tolist") else list(ids)
                                    for ids in completion_ids]
    if step is not None:
        extras["trainer_state"] = TrainerState(step)
    total = torch.zeros(len(completions), dtype=torch.float32)
    scored = torch.zeros(len(completions), dtype=torch.bool)  # a function applied to the sample
    per_function: dict[str, torch.Tensor] = {}
    for k, (fn, weight) in enumerate(zip(funcs, weights)):
        name = _reward_name(fn)
        # the same function twice (e.g. two weights): keep both in the logs
        if name in per_function:
            name = f"{name}_{k}"
        rewards, metrics = _call_reward(fn, name, prompts, completions, columns, timeout, extras)
        per_function[name] = rewards
        per_function.update({f"{name}/{key}": values for key, values in metrics.items()})
        applies = ~rewards.isnan()  # (B,) None: the function does not apply (TRL)
        total += weight * torch.where(applies, rewards, 0.0)
        scored |= applies
    if not scored.all():
        i = int((~scored).nonzero()[0])
        names = ", ".join(_reward_name(fn) for fn in funcs)
        raise RewardError(f"every reward function ({names}) returned None at sample {i} (None: the "
                          f"function does not apply to it), so it has no reward: give each sample "
                          f"at least one function that scores it\n  prompt: {_clip(prompts[i])}\n"
                          f"  completion: {_clip(completions[i])}")
    return total, per_function
