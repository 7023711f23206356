"""Worst-case time of the grader's text rules: a search for inputs on which reading an answer is not linear.

Each input is a unit repeated n times between a prefix and a suffix (long runs of spaces, "\\)", unclosed
"\\boxed{", digits, "answer is" ...: what a policy that degenerates writes). Every text rule (``extract_answer``,
``extract_gold``, the normalisation ``_prepared`` on either side, ``extract_choice`` without and with the prompt's
options, ``options_of``, ``format_reward``) is timed at
n = SMALL and n = 4 * SMALL: a linear rule takes about 4x as long, a quadratic one 16x. Rules that grow faster
than ``--ratio`` and take more than ``--min_ms`` are printed; any exception is printed with its input.
Then the end-to-end check: ``math_accuracy`` on 1 MB versions of every input, through the worker processes.

    OMP_NUM_THREADS=1 python benchmarks/grader_worst_case.py            # about 1 minute on 2 cores

Exits 1 if a rule is superlinear, raises, or a 1 MB completion is not graded within TIME_LIMIT_S + 0.5 s.
"""

import argparse
import itertools
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.tasks import choice_grader  # noqa: E402
from common.tasks import math_grader as rewards  # noqa: E402

UNITS = [" ", "\n", "\t", "  \n", "\\)", "\\]", " \\)", "\\quad", "\\quad ", "1", "12 ", "1,", "1.", "1 = ", "= ",
         "\\boxed{", "\\boxed{1} ", "{", "}", "$", "$1$ ", ". ", "**", "\\text{a}", "\\text{ and } ", "\\text{ for }",
         ", ", "x", "(", "(1, ", "%", "\\%", "\\frac{", "^{", "answer is ", "Answer: ", "#### ", "A. ", "(A) ", "a.m.",
         "Option ", "Choice_", "A: ", "\nA. ",
         "- ", "\\left(", "\\!", "\\\\", "½", "５", "<think>", "</think>", "\u2212"]
AFFIXES = [("", ""), ("1", "x\\text{a}"), ("The answer is ", "."), ("\\boxed{", ""), ("", "\\boxed{3}"),
           ("x = ", "\\text{ for } k"), ("answer is", "x"), ("<think>", "</think> 7")]
OPTIONS = {"A": "x^2/4", "B": "$x^2/8$", "C": "0.5", "D": "True, Not Given"}  # options a completion may name
RULES = {
    "extract_answer": rewards.extract_answer,
    "extract_gold": rewards.extract_gold,
    "prepared(pred)": lambda text: rewards._prepared(text, "1"),
    "prepared(gold)": lambda text: rewards._prepared("1", text),
    "extract_choice": choice_grader.extract_choice,
    "extract_choice(options)": lambda text: choice_grader.extract_choice(text, "ABCD", OPTIONS),
    "options_of": choice_grader.options_of,
    "format_reward": lambda text: rewards.format_reward(["q"], [text]),
}


def _alarm(*_):
    raise TimeoutError


def timed(rule, text: str, cap: float, repeats: int = 2) -> float:
    """Seconds `rule(text)` takes (best of `repeats`), `cap` if it runs longer; exceptions propagate."""
    best = cap
    for _ in range(repeats):
        signal.setitimer(signal.ITIMER_REAL, cap)
        start = time.perf_counter()
        try:
            rule(text)
        except TimeoutError:
            return cap
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", type=int, default=1000, help="repeats of a unit at the small size")
    parser.add_argument("--ratio", type=float, default=8.0, help="time ratio (4x the input) that counts as superlinear")
    parser.add_argument("--min_ms", type=float, default=5.0, help="ignore rules faster than this at the large size")
    parser.add_argument("--cap", type=float, default=10.0, help="seconds after which one call is stopped")
    parser.add_argument("--end_to_end_bytes", type=int, default=1_000_000,
                        help="size of each completion of the end-to-end pass through math_accuracy")
    args = parser.parse_args()
    signal.signal(signal.SIGALRM, _alarm)

    bad, slowest, start = 0, (0.0, ""), time.perf_counter()
    for unit, (prefix, suffix), (name, rule) in itertools.product(UNITS, AFFIXES, RULES.items()):
        texts = [prefix + unit * n + suffix for n in (args.small, 4 * args.small)]
        case = f"{name}({prefix!r} + {unit!r} * n + {suffix!r})"
        try:
            small, large = (timed(rule, text, args.cap) for text in texts)
        except Exception as error:  # noqa: BLE001 (a rule that raises is what we are looking for)
            print(f"RAISES  {case}: {type(error).__name__}: {error}")
            bad += 1
            continue
        def superlinear():
            return large * 1000 > args.min_ms and large > args.ratio * max(small, 1e-6)

        if superlinear():  # timed again, best of 5, before it counts: on a busy machine one preempted call looks so
            small, large = (timed(rule, text, args.cap, repeats=5) for text in texts)
        slowest = max(slowest, (large, case))
        if superlinear():
            print(f"SLOW    {case}: {small * 1000:.1f} ms at n={args.small}, "
                  f"{large * 1000:.1f} ms at n={4 * args.small}")
            bad += 1
    cases = len(UNITS) * len(AFFIXES) * len(RULES)
    print(f"{cases} cases in {time.perf_counter() - start:.0f} s; {bad} superlinear or raising; slowest "
          f"{slowest[0] * 1000:.1f} ms at n={4 * args.small}: {slowest[1]}")

    # End to end: every unit and frame again as a 1 MB completion (--end_to_end_bytes), through math_accuracy
    # (reading the answer and math-verify both run in the worker processes, under TIME_LIMIT_S).
    rewards.math_accuracy(["q"], ["warm-up: \\boxed{3}"], ["3"])
    times, timeouts = [], 0
    for unit, (prefix, suffix) in itertools.product(UNITS, AFFIXES):
        completion = prefix + unit * (args.end_to_end_bytes // len(unit)) + suffix
        start = time.perf_counter()
        result = rewards.math_accuracy(["q"], [completion], ["3"])
        times.append((time.perf_counter() - start, f"{prefix!r} + {unit!r} * n + {suffix!r}"))
        timeouts += result.metrics["timeouts"][0] > 0
    times.sort(reverse=True)
    late = [case for seconds, case in times if seconds > rewards.TIME_LIMIT_S + 0.5]
    print(f"math_accuracy on {len(times)} completions of {args.end_to_end_bytes:,} bytes: "
          f"median {times[len(times) // 2][0]:.2f} s, slowest "
          f"{times[0][0]:.2f} s ({times[0][1]}); {timeouts} timed out (reward 0, counted); {len(late)} over "
          f"TIME_LIMIT_S + 0.5 s{': ' + ', '.join(late) if late else ''}")
    bad += len(late)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
