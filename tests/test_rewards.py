"""Tests for common/tasks/rewards.py (registry, safe reward calls) and common/tasks/math_grader.py (answer extraction,
math equivalence, the time limit)."""

import itertools
import json
import math
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import common.tasks.math_grader as rewards_module
from common.tasks.choice_grader import choice_accuracy, extract_choice, options_of
from common.tasks.math_grader import (
    TIME_LIMIT_S,
    extract_answer,
    extract_gold,
    format_reward,
    is_equivalent,
    math_accuracy,
)
from common.tasks.reward_names import get_reward_function
from common.tasks.rewards import (
    REWARD_FUNCTIONS,
    RewardError,
    Rewards,
    compute_rewards,
    register_reward,
)

# --- extraction ---------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"The answer is $\boxed{\frac{1}{2}}$.", r"\frac{1}{2}"),
        (r"first \boxed{1}, then \boxed{\sqrt{\frac{a}{b}}}", r"\sqrt{\frac{a}{b}}"),  # last wins
        (r"\fbox{7}", "7"),
        (r"\boxed{5} then cut off \boxed{\frac{1}{2", "5"),  # unclosed box is skipped
        (r"<think>maybe \boxed{7}, or 99</think> so it is 12", "12"),  # think block ignored
        ("<think>first 5, no wait, 6", "6"),  # no </think>: nothing to ignore
        ("She pays 3 * 4 = 12\n#### 1,234", "1234"),
        ("It costs -3.5 dollars", "-3.5"),
        ("Total 1,234 apples, 7 crates and 2.25 kg", "2.25"),
        ("the sum is 1,234.", "1234"),
        ("from 3-4", "3-4"),  # the trailing expression is kept whole (LaTeX-aware), not cut to its last digits
        ("no digits here", None),
        ("<think>42</think> I give up", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("48/2 = 24 clips in May.\n#### 1,234", "1234"),
        ("#### 72", "72"),
        (r"So $x = \boxed{\dfrac{1}{2}}$, and \boxed{\{1,2\}} is the set.", r"\{1,2\}"),
        ("  \\frac{3}{4}\n", r"\frac{3}{4}"),
    ],
)
def test_extract_gold(answer, expected):
    assert extract_gold(answer) == expected


# --- equivalence ----------------------------------------------------------------


@pytest.mark.parametrize(
    "pred, gold",
    [
        (r"\frac{1}{2}", "0.5"),
        ("0.5", r"\frac{1}{2}"),
        (r"\dfrac{1}{2}", r"\frac12"),
        ("1,234", "1234"),
        ("x=3", "3"),
        (r"\left(1,2\right)", "(1,2)"),
        (r"10^\circ", "10"),
        ("18.", "18"),  # math-verify cannot parse "18."; the string fallback catches it
        (r"5\text{ cm}", "5"),
        (r"\text{Monday}", "Monday"),
        ("$-3$", "-3.0"),
    ],
)
def test_equivalent(pred, gold):
    assert is_equivalent(pred, gold)


@pytest.mark.parametrize(
    "pred, gold",
    [("2", "3"), (r"\frac{1}{3}", "0.33"), (None, "5"), ("", ""), ("}", "5"), ("(1,2)", "(2,1)")],
)
def test_not_equivalent(pred, gold):
    assert not is_equivalent(pred, gold)


# An answer wholly in English words is read as the number it names; anything else stays words (and so wrong).
@pytest.mark.parametrize(
    "pred, gold",
    [
        ("twelve", "12"),
        ("Twelve.", "12.0"),
        (r"\text{twelve}", "12"),
        ("$twelve$", "12"),
        ("Twenty-five", "25"),
        ("twenty five", "25"),
        ("two hundred and five", "205"),
        ("one thousand two hundred thirty-four", "1,234"),
        ("two thousand twenty-six", "2026"),
        ("zero", "0"),
        ("negative three", "-3"),
        ("one half", r"\frac{1}{2}"),
        ("a half", "0.5"),
        ("three quarters", r"\dfrac34"),
        ("two thirds", "2/3"),
        ("12", r"\text{twelve}"),  # a reference in words reads the same way
    ],
)
def test_number_words_equivalent(pred, gold):
    assert is_equivalent(pred, gold)


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("twelve", "13"),
        ("sixty", "16"),
        ("two thirds", "3/2"),
        ("three halves", "0.5"),
        ("negative three", "3"),
        ("twelve apples", "12"),  # not wholly a number
        ("one or two", "1"),
        ("a dozen", "12"),  # not a number word we read
        ("nineteen ninety", "1990"),  # year-style, not the grammar of a number
        ("five five", "10"),
        ("twenty twenty", "40"),
        ("hundred", "100"),
        ("second", "2"),
    ],
)
def test_number_words_not_equivalent(pred, gold):
    assert not is_equivalent(pred, gold)


def test_number_words_only_in_the_final_answer():
    completions = [r"so the count is \boxed{\text{twelve}}", "so the count is twelve", r"\boxed{twelve} or 13"]
    assert math_accuracy(["q"] * 3, completions, answer=["12"] * 3) == [1.0, 0.0, 1.0]


def test_is_equivalent_in_worker_thread():
    """math-verify's SIGALRM timeouts raise outside the main thread unless they are turned off."""
    results = []
    worker = threading.Thread(target=lambda: results.append(is_equivalent(r"\frac{1}{2}", "0.5")))
    worker.start()
    worker.join()
    assert results == [True]


# --- built-in rewards -------------------------------------------------------------


def test_math_accuracy():
    completions = [
        r"<think>1/2 of 1 is 0.5</think> \boxed{\frac{1}{2}}",
        r"<think>easy</think> \boxed{3}",
        "#### 1,234",
        "I don't know",
    ]
    answer = ["0.5", r"... so \boxed{4}", "Work.\n#### 1,234", "7"]
    assert math_accuracy(["q"] * 4, completions, answer=answer, extra_column=[0] * 4) == [1.0, 0.0, 1.0, 0.0]


def test_format_reward():
    completions = [
        r"<think>work</think> \boxed{4}",  # closed thinking, then an answer
        r"\boxed{4}",  # no thinking at all is fine
        r"<think>work \boxed{4}",  # never closed its thinking
        r"<think>\boxed{4}</think> so four",  # the box is inside the thinking only
        "<think>work</think> 4",  # no box
        r"<think>work</think> \boxed{4",  # unclosed box
    ]
    assert format_reward(["q"] * 6, completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


# --- registry -----------------------------------------------------------------------


def test_registry_lookup():
    assert get_reward_function("math_accuracy") is math_accuracy
    assert get_reward_function("format") is format_reward
    assert get_reward_function("common.tasks.math_grader:format_reward") is format_reward


def test_register_reward():
    @register_reward("test_constant")
    def constant(prompts, completions, **_):
        return [0.25] * len(completions)

    try:
        assert get_reward_function("test_constant") is constant
    finally:
        del REWARD_FUNCTIONS["test_constant"]


@pytest.mark.parametrize("name", ["no_such_reward", "common.tasks.rewards:no_such_function", "no_such_module:fn"])
def test_unknown_reward_function(name):
    with pytest.raises(ValueError) as info:
        get_reward_function(name)
    if ":" not in name:  # the message teaches both ways to name a function
        assert "math_accuracy" in str(info.value) and "module:function" in str(info.value)


# --- compute_rewards ------------------------------------------------------------------


PROMPTS = ["What is 1+1?", "What is 2+2?"]
COMPLETIONS = [r"<think>1+1</think> \boxed{2}", "it is 5"]
COLUMNS = {"answer": ["2", "4"]}


def test_compute_rewards_weighted_sum():
    total, per_function = compute_rewards(
        [math_accuracy, format_reward], [1.0, 0.5], PROMPTS, COMPLETIONS, COLUMNS
    )
    assert total.dtype == torch.float32 and total.shape == (2,)
    assert total.tolist() == [1.5, 0.0]
    assert set(per_function) == {"math_accuracy", "math_accuracy/timeouts", "format"}
    assert per_function["math_accuracy"].tolist() == [1.0, 0.0]
    assert per_function["math_accuracy/timeouts"].tolist() == [0.0, 0.0]
    assert per_function["format"].tolist() == [1.0, 0.0]


def test_compute_rewards_default_weights_and_unregistered_name():
    def length(prompts, completions, **_):
        return [len(c) for c in completions]

    total, per_function = compute_rewards([length, format_reward], None, PROMPTS, COMPLETIONS, COLUMNS)
    assert total.tolist() == [len(COMPLETIONS[0]) + 1.0, len(COMPLETIONS[1])]
    assert set(per_function) == {"length", "format"}


def test_a_reward_may_return_none_where_it_does_not_apply():
    """TRL's convention for mixed data sets: None means the function does not score that sample. Its value there is
    NaN in the per-function values and leaves the weighted sum; a sample that no function scores stops the run,
    named."""
    def math_only(completions, task, **kwargs):
        return [1.0 if t == "math" else None for t in task]

    def code_only(completions, task, **kwargs):
        return [0.5 if t == "code" else None for t in task]

    columns = {"task": ["math", "code"]}
    total, per_function = compute_rewards([math_only, code_only], [2.0, 4.0], PROMPTS, COMPLETIONS, columns)
    assert total.tolist() == [2.0, 2.0]
    assert per_function["math_only"][0] == 1.0 and per_function["math_only"][1].isnan()
    assert per_function["code_only"][0].isnan() and per_function["code_only"][1] == 0.5
    with pytest.raises(RewardError, match=r"every reward function \(math_only\) returned None at sample 1"):
        compute_rewards([math_only], None, PROMPTS, COMPLETIONS, columns)


def test_compute_rewards_weight_length_mismatch():
    with pytest.raises(ValueError, match="2 reward functions but 1 weights"):
        compute_rewards([math_accuracy, format_reward], [1.0], PROMPTS, COMPLETIONS, COLUMNS)


def test_reward_error_on_exception_names_sample():
    def fragile(prompts, completions, answer, **_):
        return [1.0 / (c.count("5") - 1) for c in completions]  # ZeroDivisionError on "it is 5" only

    with pytest.raises(RewardError) as info:
        compute_rewards([fragile], None, PROMPTS, COMPLETIONS, COLUMNS)
    message = str(info.value)
    assert "fragile" in message and "sample 1" in message and "it is 5" in message and "What is 2+2?" in message
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_reward_error_truncates_long_text():
    def always_fails(prompts, completions, **_):
        raise KeyError("boom")

    with pytest.raises(RewardError) as info:
        compute_rewards([always_fails], None, PROMPTS, ["x" * 5000, "y"], COLUMNS)
    assert "always_fails" in str(info.value) and "sample 0" in str(info.value)
    assert len(str(info.value)) < 1000
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize("bad", [math.nan, math.inf, None])
def test_reward_error_on_non_finite(bad):
    def broken(prompts, completions, **_):
        return [1.0, bad]

    with pytest.raises(RewardError) as info:
        compute_rewards([broken], None, PROMPTS, COMPLETIONS, COLUMNS)
    assert "broken" in str(info.value) and "sample 1" in str(info.value) and "it is 5" in str(info.value)


@pytest.mark.parametrize("huge", [1e39, -1e16])
def test_a_reward_too_large_for_float32_statistics_names_its_function(huge):
    """1e39 is a finite Python float but inf in float32 (and 1e16's square overflows a group's std): a NaN loss
    later would name no reward function. Refused here, naming the function, the sample and the bound."""
    def huge_reward(prompts, completions, **_):
        return [1.0, huge]

    with pytest.raises(RewardError) as info:
        compute_rewards([huge_reward], None, PROMPTS, COMPLETIONS, COLUMNS)
    message = str(info.value)
    assert "'huge_reward'" in message and "sample 1" in message and "rewards must stay within +-1e+15" in message


def test_reward_error_on_wrong_length():
    def short(prompts, completions, **_):
        return [1.0]

    with pytest.raises(RewardError, match=r"'short' returned 1 rewards for 2 completions"):
        compute_rewards([short], None, PROMPTS, COMPLETIONS, COLUMNS)


def test_compute_rewards_column_length_mismatch():
    with pytest.raises(ValueError, match="'answer' has 1 entries"):
        compute_rewards([math_accuracy], None, PROMPTS, COMPLETIONS, {"answer": ["2"]})


# --- the grader on answers as models write them (issue 15) ------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Final Answer: The final answer is $\\frac{4}{35}$. I hope it is correct.", r"\frac{4}{35}"),  # Minerva
        ("**Final Answer**\n\n\\[ \\frac{4}{35} \\]", r"\frac{4}{35}"),  # Qwen / DeepSeek without a box
        ("so the answer is $\\$118,000$.", r"\$118,000"),
        ("The answer is 34 hours.", "34"),
        ("The answer is therefore 3.", "3"),
        ("so the length is $\\sqrt{17}$", r"\sqrt{17}"),  # trailing expression, not its last digits
        ("the area comes to 16\\pi", r"16\pi"),
        ("which gives $-\\frac{24}{25}$", r"-\frac{24}{25}"),
        ("So she works 34 hours. The total is 34 hours in 4 weeks", "34"),  # first expression after "is"
        ("The house sold for $118 000", "$118 000"),
        ("They meet at 2:00 pm", "2:00"),
        ("The roots are $\\boxed{-1}$ and $\\boxed{-9}$.", "-1, -9"),  # boxes side by side: one answer
        ("\\boxed{5}. Checking again, the result is \\boxed{6}", "6"),
        ("#### For \\(T = 3\\):\nthe count is 7", "7"),  # a Markdown heading is not an answer
        ("She has 9 eggs.\nA: 9", "9"),
        ("He has 3 * 12 = <<3*12=36>>36 pencils left", "36"),
        ("½ of it", r"\frac{1}{2}"),
        ("I am not sure how to go on", None),
    ],
)
def test_extract_answer_as_models_write(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "pred, gold",
    [("17.5", r"17.5\%"), (r"12.5\%", "12.5"), ("25", r"25\%"), (r"8\sqrt{3}", r"8\sqrt{3}\text { square inches}"),
     (r"\textbf{(073)}", "073"), ("½", "0.5"), ("５", "5"), ("√2", r"\sqrt{2}"), ("3½", "3.5"), ("2:00", "2"),
     (r"\$118,000", "118000"), ("€28", "28")],
)
def test_normalisation_equivalent(pred, gold):
    assert is_equivalent(pred, gold)


@pytest.mark.parametrize("pred, gold", [("17.5%", "0.175"), ("-1, -9", "-9, -2"), ("2:30", "2"), ("(073)", "74")])
def test_normalisation_not_equivalent(pred, gold):
    assert not is_equivalent(pred, gold)


def test_order_comes_from_the_prompt():
    completions = [r"\boxed{2, 3, 4}"] * 2 + [r"\boxed{2, 4, 3}"]
    prompts = ["Find the ordered triple (a, b, c).", "Enter all solutions, separated by commas.",
               "Find the ordered triple."]
    assert math_accuracy(prompts, completions, answer=["2, 4, 3"] * 3) == [0.0, 1.0, 1.0]


def test_references_that_are_numbers_or_none():
    completions = [r"\boxed{12}", r"\boxed{0.5}", r"\boxed{3}", "the answer is 1e-7", r"\boxed{12}"]
    with pytest.warns(UserWarning, match="1 of 5 samples have no reference answer.*sample 4"):
        rewards = math_accuracy(["q"] * 5, completions, answer=[12, 0.5, 3.0, 1e-7, None])
    assert rewards == [1.0, 1.0, 1.0, 0.0, 0.0]  # "1e-7" is read as its leading expression "1"
    assert extract_gold(3.0) == "3" and extract_gold(1e-7) == "0.0000001" and extract_gold(12) == "12"
    total, per_function = compute_rewards([math_accuracy], None, ["q"], [r"\boxed{7}"], {"answer": [7]})
    assert total.tolist() == [1.0]


def test_regression_set(monkeypatch):
    """Hand-written cases of every failure class in issue 15 (tests/data/grader_cases.jsonl, built by
    tests/data/make_grader_cases.py); each names the rule it tests. Agreement measured: 267 of 267.
    The time limit is raised: on a loaded machine "x^2 + 2x" against "x(x+2)" can take a second, and
    this test is about reading answers (the limit has tests of its own below)."""
    monkeypatch.setattr(rewards_module, "TIME_LIMIT_S", 30.0)
    cases = [json.loads(line) for line in (Path(__file__).parent / "data" / "grader_cases.jsonl").open()]
    rewards = math_accuracy([c.get("prompt", "") for c in cases], [c["completion"] for c in cases],
                            answer=[c["answer"] for c in cases])
    wrong = [(c["rule"], c["completion"], c["answer"]) for c, r in zip(cases, rewards) if r != c["correct"]]
    print(f"agreement {len(cases) - len(wrong)}/{len(cases)}")
    assert len(cases) >= 200 and {c["correct"] for c in cases} == {0, 1}
    assert not wrong and sum(rewards.metrics["timeouts"]) == 0


def _wait_for_workers():
    """Until every grading worker has started (a killed one restarts in the background): time the grading only."""
    pool, deadline = rewards_module._pool(), time.monotonic() + 60
    while not (pool.workers and all(w.ready for w in pool.workers)) and time.monotonic() < deadline:
        pool.run([("verify", "x^2", r"x \cdot x", False)], [30.0])


HANGS = [
    r"\boxed{9^{9^{9^9}}}",  # sympy evaluates the tower while holding the GIL
    r"\boxed{1000000!}",
    "\\boxed{" + "{" * 450 + "1" + "}" * 450 + "}",  # 5,000 levels: longer than MAX_ANSWER_CHARS, so refused at once
]


@pytest.mark.parametrize("completion, answer", [(c, "3") for c in HANGS] + [(r"\boxed{3}", r"9^{9^{9^9}}")])
def test_pathological_answers_time_out_in_a_worker_thread(completion, answer):
    """A hard limit per sample, in any thread: reward 0, counted, and the pool goes on grading."""
    _wait_for_workers()
    results = []
    worker = threading.Thread(target=lambda: results.append((time.monotonic(), math_accuracy(
        ["q", "q"], [completion, r"\boxed{\frac{1}{2}}"], answer=[answer, "0.5"]), time.monotonic())))
    worker.start()
    worker.join(timeout=30)
    start, rewards, end = results[0]
    assert rewards == [0.0, 1.0] and rewards.metrics["timeouts"] == [1.0, 0.0]
    assert end - start < TIME_LIMIT_S + 0.5
    assert math_accuracy(["q"], [r"\boxed{x^2}"], answer=["x \\cdot x"]) == [1.0]  # a fresh worker took over


MB = 1_000_000
# A bound between linear and worse on 1 MB inputs, far from both: linear extraction takes 0.03-0.4 s here, and 1.4 s
# on CI's loaded cores (a 1.0 s bound failed there); quadratic backtracking on 1 MB takes hours.
LINEAR_S = 10.0
DEGENERATE = [  # (1 MB completion, its verdict for the reference 3): what a policy that degenerates writes
    ("\\boxed{" * (MB // 7) + r"\boxed{3}", 1.0),  # many unclosed boxes: 3 s for 20k characters, once
    ("x " * (MB // 2) + r"\boxed{3}", 1.0),
    ("1 = " * (MB // 4) + "3", 1.0),
    ("{" * (MB // 2) + "}" * (MB // 2), 0.0),
    ("1" + " " * MB + r"x\text{a}", 0.0),  # 4.0 s at 20,000 spaces, when extraction ran in the caller
    ("\\)" * (MB // 2) + " so 3", 1.0),
    (r"\quad" * (MB // 5) + r"\text{ for } 3", 0.0),
    ("½" * MB + " The answer is 3.", 1.0),  # 11 MB once written as LaTeX
    (r"\boxed{1} " * (MB // 10) + r"\boxed{3}", 0.0),  # 100,000 boxes side by side are one (wrong) answer
    ("The answer is " + "(1, " * (MB // 4), 0.0),
    ("answer is" + " " * MB + "3", 1.0),
]


@pytest.mark.parametrize("completion, verdict", DEGENERATE, ids=[c[:12] + "..." for c, _ in DEGENERATE])
def test_a_degenerate_megabyte_is_graded_in_a_worker_thread(completion, verdict):
    """A 1 MB completion is read and graded within the time limit, from any thread, with no timeout: reading the
    answer runs in the worker processes too, and every rule is linear (benchmarks/grader_worst_case.py searches)."""
    _wait_for_workers()
    results = []
    worker = threading.Thread(target=lambda: results.append((time.monotonic(), math_accuracy(
        ["q"], [completion], answer=["3"]), time.monotonic())))
    worker.start()
    worker.join(timeout=30)
    start, rewards, end = results[0]
    assert rewards == [verdict] and rewards.metrics["timeouts"] == [0.0]
    assert end - start < TIME_LIMIT_S + 0.5


def test_only_the_end_of_a_completion_is_read():
    """The last READ_CHARS characters: an answer followed by more than that is not the final answer."""
    assert extract_answer(r"\boxed{3}" + " x" * rewards_module.READ_CHARS) is None
    assert extract_answer(r"\boxed{3}" + " x" * (rewards_module.READ_CHARS // 2 - 10)) == "3"
    long_answer = r"\boxed{" + "1+" * rewards_module.MAX_ANSWER_CHARS + "1}"
    assert math_accuracy(["q"], [long_answer], answer=["3"]) == [0.0]  # too long to be an answer: not parsed


# --- multiple choice (issue 31) ------------------------------------------------------------

# The prompt's options in the forms prompts list them, with the letters read back.
@pytest.mark.parametrize("prompt", [
    "Which is the focus?\n\nA. x^2/4\nB. $x^2/8$\nC. 0.5\nD. True, Not Given",  # benchmark_sets.py format_choices
    "Which is the focus?\nA: x^2/4\nB: $x^2/8$\nC: 0.5\nD: True, Not Given",  # colons (read as A-J before)
    "Which is the focus?\n(A) x^2/4\n(B) $x^2/8$\n(C) 0.5\n(D) True, Not Given",  # (A) (read as A-J before)
    "Which is the focus?\nA) x^2/4\nB) $x^2/8$\nC) 0.5\nD) True, Not Given",
    "Question: Which is the focus?\nOptions: A. x^2/4\nB. $x^2/8$\nC. 0.5\nD. True, Not Given\n",  # MMLU-Pro (A lost)
    "Question: 1+1?\nOptions: A. 2\nB. 3\nAnswer: The answer is (A).\n\n"  # a few-shot prompt: the last list counts
    "Question: Which is the focus?\nOptions: A. x^2/4\nB. $x^2/8$\nC. 0.5\nD. True, Not Given\nAnswer: ",
])
def test_options_of_the_prompt(prompt):
    assert options_of(prompt) == {"A": "x^2/4", "B": "$x^2/8$", "C": "0.5", "D": "True, Not Given"}
    assert choice_accuracy([prompt] * 3, ["The answer is A", "The answer is J", "the answer is x^2/8"],
                           answer=["A", "J", "B"]) == [1.0, 0.0, 1.0]


def test_options_of_other_lines():
    assert options_of("no options listed") == {}
    assert options_of("Which hold?\nI. x > 0\nII. y > 0\nA. I only\nB. II only") == {"A": "I only", "B": "II only"}
    assert options_of("A: Hello.\nB: Hi.\nWho spoke first?\nA. Ann\nB. Bob\nC. Cy") == {"A": "Ann", "B": "Bob",
                                                                                      "C": "Cy"}
    assert options_of("A. x\nB. y\nD. z") == {"A": "x", "B": "y"}  # stops where the letters stop following


OPTIONS = {"A": "x^2/4", "B": "$x^2/8$", "C": "0.5", "D": "True, Not Given"}


# The forms issue 31 names, as models write them. "before" is what extract_choice read at 0979451.
@pytest.mark.parametrize("text, letter", [
    ("The answer is Choice_B", "B"),  # before: None
    ("The answer is Choice_B.", "B"),  # before: None
    ("Choice_B", "B"),  # before: None
    ("Choice B", "B"),
    ("Option B", "B"),
    ("I pick Option B because it fits", "B"),  # before: None
    ("Option B is right; options A and C are not.", "B"),  # before: C
    ("The correct option is B because the parabola opens upwards", "B"),  # before: None
    ("Answer: Choice B", "B"),
    ("Option (B)", "B"),
    ("The answer is Option (B).", "B"),
    ("(B) x^2/8", "B"),
    ("the answer is B: x^2/8", "B"),
    ("The answer is **B. $x^2/8$**", "B"),
    ("Let's check each option:\nA. wrong\nB. wrong\nC. right\nSo C.", "C"),  # an option list, not "option: A"
    (r"The answer is \( B \).", "B"),  # before: None (MMLU-Pro gpt4o-7691)
    (r"The answer is \( D. 0.39 \).", "D"),
    ("the correct answer is:\n\nA. x\n\nHowever, this does not match. The correct answer should be:\n\nC. y",
     "C"),  # before: A (MMLU-Pro deepseek-11304)
    (r"Solution: Choice\_C", "C"),  # Markdown's escaped underscore; before: None
    (r"The answer is Choice\_C.", "C"),  # before: None
    (r"Option\_C", "C"),  # before: None
])
def test_extract_choice_forms(text, letter):
    assert extract_choice(text) == letter
    assert extract_choice(text, "ABCD", OPTIONS) == letter


# A list of letters is no answer (docs/grader.md): a policy paid for the letter read from a list (its first or last)
# would learn to list them. "before" is what extract_choice read before this rule.
@pytest.mark.parametrize("text", [
    "A, B, C, or D",  # before: D
    "A, B, C and D",  # before: D
    "It could be A, B, C or D.",  # before: D
    "None of the choices (A, B, C, or D) is correct.",  # before: D
    "(A), (B) or (C)",  # before: C
    "A/B/C",  # before: C
    "either B or C",  # before: C
    "The answer is either B or C.",  # before: C
    "neither A nor B.",  # before: B
    "The answer is A, B, C or D.",  # before: A
    "The answer is (A) or (B).",  # before: A
    "The answer is A and B",  # before: A
    "The answer is A,B",  # before: B
    "The answer is **A** or **B**.",  # before: A
    "Answer: A/B/C/D",  # before: A
    "Answer: (A), (B), (C), (D)",  # before: A
    "Option A or Option B",  # before: B
    "Choice_A, Choice_B",  # before: B
    r"Choice\_A or Choice\_B",  # before: None
    r"\boxed{A, B}",  # before: A
    r"\boxed{A/B/C/D}",  # before: A
    r"\boxed{A or B}",  # before: A
    r"\boxed{\text{A, B, C, D}}",  # before: A
    r"\boxed{(A), (B)}",  # before: A
    r"\boxed{A}, \boxed{B}",  # boxes side by side; before: B
    r"\boxed{A} or \boxed{D}",  # before: D
])
def test_a_list_of_letters_is_no_answer(text):
    assert extract_choice(text) is None
    assert extract_choice(text, "ABCD", OPTIONS) is None


# A letter stated after a list, or a list that is no final answer, still counts.
@pytest.mark.parametrize("text, letter", [
    ("The options are A, B, C or D. The answer is C.", "C"),
    ("It could be A, B, C or D. I pick C.", "C"),
    ("It is either B or C. So C.", "C"),
    ("(A), (B) or (C)? The answer is (C).", "C"),
    (r"Not \boxed{A, B}: the answer is \boxed{C}", "C"),
    (r"\boxed{A} is wrong, so the answer is \boxed{C}", "C"),  # boxes apart, not side by side
    (r"\boxed{C} \boxed{C}", "C"),  # one letter twice
    ("The answer is C. A, B and D are wrong.", "C"),
    ("The answer is C, D is wrong.", "C"),  # "D is wrong": a clause after the answer, not "C, D"
    ("The answer is B and I think it fits.", "B"),  # "I" the pronoun
    ("The answer is C; D is wrong", "C"),
    ("Choice_A Choice_B", "B"),  # a space alone is no separator (test_choice_forms_are_linear)
])
def test_a_letter_after_a_list_counts(text, letter):
    assert extract_choice(text) == letter
    assert extract_choice(text, "ABCD", OPTIONS) == letter


# Reward hacking: whatever the gold letter, a completion that lists several letters, or every letter, earns nothing.
LISTING_COMPLETIONS = [
    "It could be A, B, C or D.", "The answer is A, B, C, or D.", "The answer is A, B, C and D.",
    "None of the choices (A, B, C, or D) is correct.", "(A), (B), (C) or (D)", "A/B/C/D", r"\boxed{A, B, C, D}",
    r"\boxed{A}, \boxed{B}, \boxed{C}, \boxed{D}", "Option A, Option B, Option C or Option D",
    r"Choice\_A, Choice\_B, Choice\_C or Choice\_D", "The answer is either A or B.", "either C or D",
    "The answer is (B) or (C).", "A or D.", r"\boxed{C/D}", "The answer is A and B and C and D.",
]


@pytest.mark.parametrize("gold", "ABCD")
def test_listing_letters_earns_no_reward(gold):
    from common.tasks.benchmark_sets import format_choices
    prompt = format_choices("Where is the focus of y = 2x^2?", ["(0, 1/8)", "(0, 1/4)", "(1/8, 0)", "(0, 2)"])
    assert options_of(prompt) == {"A": "(0, 1/8)", "B": "(0, 1/4)", "C": "(1/8, 0)", "D": "(0, 2)"}
    n = len(LISTING_COMPLETIONS)
    assert choice_accuracy([prompt] * n, LISTING_COMPLETIONS, answer=[gold] * n) == [0.0] * n
    assert choice_accuracy([prompt] * n, LISTING_COMPLETIONS, answer=["ABCD".index(gold)] * n) == [0.0] * n
    assert choice_accuracy([prompt], [f"The options are A, B, C or D. The answer is {gold}."], answer=[gold]) == [1.0]


# A completion that names the option's text: the one option whose text matches (with the prompt's options only).
@pytest.mark.parametrize("text, letter", [
    ("the answer is x^2/8", "B"),  # before: None
    (r"so the focus is at \boxed{x^2/8}", "B"),  # before: None
    ("The answer is $x^2/8$.", "B"),
    ("After checking (A) and (C), the answer is x^2/8, since the focus is at 2.", "B"),  # before: C
    ("Answer: true, not given", "D"),
    ("The answer is 0.50.", "C"),  # equal as numbers (_quick_verdict)
    (r"The answer is \boxed{\text{True, Not Given}}", "D"),
    ("The answer is x^2/16", None),  # no option's text
    ("The answer is 1/2", None),  # equal to C only by math-verify, which is not called here
])
def test_extract_choice_option_text(text, letter):
    assert extract_choice(text, "ABCD", OPTIONS) == letter


def test_option_text_must_name_one_option():
    assert extract_choice("the answer is 5", "ABC", {"A": "5", "B": "$5$", "C": "6"}) is None  # two options say 5
    assert extract_choice("the answer is 5", "ABC", {"A": "5", "B": "7", "C": "6"}) == "A"
    assert extract_choice("the answer is \x005", "ABC", {"A": "5", "B": "7", "C": "6"}) == "A"  # a NUL is dropped


def test_choice_extraction_is_linear():
    """extract_choice runs in the caller: "answer is" then 1,000,000 spaces took minutes (cubic backtracking)."""
    start = time.perf_counter()
    assert extract_choice("answer is" + " " * MB + "x") is None
    assert extract_choice("The answer is" + "\n" * MB + "(B)") == "B"
    assert extract_choice("(A) " * (MB // 4) + "answer: C") == "C"
    assert time.perf_counter() - start < LINEAR_S


def test_lists_of_letters_are_read_in_linear_time():
    start = time.perf_counter()
    assert extract_choice("A, " * (MB // 3) + "B.") is None
    assert extract_choice("The answer is A" + ", B" * (MB // 3)) is None
    assert extract_choice("(A) or " * (MB // 7) + "answer: C") == "C"
    assert extract_choice("A, " * (MB // 3) + r"\boxed{C}") == "C"
    assert extract_choice(r"\boxed{A}, " * (MB // 12) + r"\boxed{B}") is None
    assert extract_choice("Option A or " * (MB // 12) + "the answer is" + " " * MB + "x^2/8", "ABCD", OPTIONS) == "B"
    assert time.perf_counter() - start < LINEAR_S


@pytest.mark.parametrize("text", ["Option " * (MB // 7) + "B", "the answer is " * (MB // 14) + "x^2/8",
                                  "Choice_A " * (MB // 9) + "Choice_B", "the answer is" + " " * MB + "x^2/8"])
def test_choice_forms_are_linear(text):
    """The forms of issue 31 (Option B, Choice_B, an option's text after "the answer is") on 1 MB inputs."""
    start = time.perf_counter()
    assert extract_choice(text, "ABCD", OPTIONS) == "B"
    assert time.perf_counter() - start < LINEAR_S


def test_option_lines_are_read_in_linear_time():
    start = time.perf_counter()
    assert options_of("A. " * (MB // 3)) == {"A": "A. " * (MB // 3 - 1)}
    assert options_of("\n(A) " * (MB // 5)) == {"A": ""}
    assert time.perf_counter() - start < LINEAR_S


def test_text_rules_never_raise():
    """Every rule on short repetitions of the units the worst-case benchmark uses: no exception (one reached
    ``_run_value`` with no number in its run); a worker's exception would stop the run."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
    from grader_worst_case import AFFIXES, UNITS
    for unit, (prefix, suffix), n in itertools.product(UNITS, AFFIXES, (1, 3)):
        text = prefix + unit * n + suffix
        extract_answer(text), extract_gold(text), extract_choice(text)
        rewards_module._prepared(text, "1"), rewards_module._prepared("1", text)
    assert rewards_module._run_value("x = a") == ""


def test_a_bug_in_a_worker_is_raised_in_the_caller():
    """A rule that raises in a worker process surfaces as a RuntimeError with the worker's traceback, not as a
    wrong reward, and the pool keeps grading."""
    with pytest.raises(RuntimeError, match="KeyError: 'no such task'"):
        rewards_module._pool().run([("no such task",)], [5.0])
    assert math_accuracy(["q"], [r"\boxed{3}"], answer=["3"]) == [1.0]


def test_timeouts_reach_the_logs():
    total, per_function = compute_rewards([math_accuracy], None, ["q", "q"], [HANGS[1], r"\boxed{2}"],
                                          {"answer": ["3", "2"]})
    assert total.tolist() == [0.0, 1.0]
    assert per_function["math_accuracy/timeouts"].tolist() == [1.0, 0.0]


def test_reward_metrics_must_have_one_value_per_completion():
    def bad_metrics(prompts, completions, **_):
        return Rewards([1.0] * len(completions), {"odd": [1.0]})

    with pytest.raises(RewardError, match="returned 1 values of metric 'odd' for 2 completions"):
        compute_rewards([bad_metrics], None, PROMPTS, COMPLETIONS, COLUMNS)


def test_control_characters_are_dropped_before_grading():
    """A NUL (or an escape, a carriage return) that a tokenizer decodes inside the answer does not make it wrong."""
    assert extract_answer("so \\boxed{3\x00}") == "3"
    assert math_accuracy(["q", "q", "q"], ["\\boxed{3\x00}", "The answer is \x1b4.", "\\boxed{\\frac{1}{2}}\r"],
                         answer=["3", "4", "0.5"]) == [1.0, 1.0, 1.0]


def test_a_reward_that_never_returns_is_stopped_at_its_time_limit():
    """compute_rewards(..., timeout): a function that hangs raises a RewardError naming it after `timeout` seconds
    (the run stops instead of hanging); one that returns in time, or raises, behaves as without a limit."""
    import threading
    import time

    from common.tasks.rewards import RewardError, compute_rewards

    never = threading.Event()

    def hangs(prompts, completions, **_):
        never.wait()  # released at the end of the test, so the daemon thread ends too
        return [0.0] * len(completions)

    start = time.time()
    with pytest.raises(RewardError, match=r"reward function 'hangs' did not return within 0.5 s \(--reward_timeout\)"):
        compute_rewards([hangs], None, ["p"], ["c"], {}, timeout=0.5)
    assert time.time() - start < 5
    never.set()
    total, _ = compute_rewards([lambda p, c, **_: [2.0] * len(c)], None, ["p", "q"], ["c", "d"], {}, timeout=5)
    assert total.tolist() == [2.0, 2.0]

    def raises(prompts, completions, **_):
        raise ValueError("boom")

    with pytest.raises(RewardError, match="raised ValueError: boom"):
        compute_rewards([raises], None, ["p"], ["c"], {}, timeout=5)


@pytest.mark.parametrize("completion", ["25 + 60 = \\boxed{}", "25 + 60 = $\\boxed{}$", "25+60=\\(\\boxed{ }\\)",
                                        "So 25 + 60 = \\fbox{}"])
def test_an_empty_box_after_an_equals_sign_is_no_answer(completion):
    """"25 + 60 = \\boxed{}" restates the question: the expression before "=" is not the answer, and the box that
    should hold it is empty. Read as the trailing expression it scored 1 (math-verify evaluates 25 + 60 to 85), and a
    policy on --preset smollm2 learned to write exactly this (docs/real-model.md)."""
    assert extract_answer(completion) is None
    assert list(math_accuracy(["What is 25 + 60?"], [completion], ["85"])) == [0.0]
    assert list(math_accuracy(["What is 25 + 60?"], ["25 + 60 = \\boxed{85}"], ["85"])) == [1.0]


def test_the_math_grader_under_a_time_limit_grades_every_call_alike():
    """math_accuracy's worker processes die with the thread that started them (PR_SET_PDEATHSIG): reward calls under
    --reward_timeout run on one long-lived thread, so a second and third call grade as the first (with a thread per
    call the workers died after the first, and "\\boxed{2}" against 2 scored 0 in the next)."""
    grader = get_reward_function("math_accuracy")
    completions, answers = ["\\boxed{2}", "x = 3", "\\boxed{\\frac{1}{2}}"], ["2", "3", "0.5"]
    rewards_module._close_pool()  # the pool is started inside the first timed call, as in a run
    for _ in range(3):
        total, _ = compute_rewards([grader], None, ["q"] * 3, completions, {"answer": answers}, timeout=60)
        assert total.tolist() == [1.0, 1.0, 1.0]


# --- rewards written as TRL users write them (issue 52, item 1) ----------------------------------

# Copied in the style of TRL's documentation (GRPOTrainer, "Using a custom reward function"): called
# by keyword, columns by name, everything else in **kwargs.
TRL_REWARDS = '''
CALLS = []


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def exact_answer(completions, answer, **kwargs):
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answer)]


def recorder(prompts, completions, completion_ids, trainer_state, **kwargs):
    CALLS.append({"prompts": len(prompts), "ids": completion_ids, "step": trainer_state.global_step,
                  "columns": sorted(kwargs)})
    return [0.0] * len(completions)
'''


@pytest.fixture
def trl_rewards(tmp_path):
    path = tmp_path / "trl_rewards.py"
    path.write_text(TRL_REWARDS)
    return str(path)


def test_a_trl_reward_is_called_by_keyword_with_ids_and_state(trl_rewards):
    from common.tasks.reward_files import load_file

    funcs = [get_reward_function(f"{trl_rewards}:{n}") for n in ("reward_len", "exact_answer", "recorder")]
    total, per = compute_rewards(funcs, None, PROMPTS, ["2", "it is 5"], COLUMNS, completion_ids=[[5], [7, 8]],
                                 step=3)
    assert per["reward_len"].tolist() == [-19, -13] and per["exact_answer"].tolist() == [1, 0]
    assert total.tolist() == [-18, -13]
    calls = load_file(trl_rewards).CALLS
    assert calls == [{"prompts": 2, "ids": [[5], [7, 8]], "step": 3, "columns": ["answer"]}]


def test_the_project_s_positional_rewards_still_work():
    def positional(p, c, **columns):  # names of its own: called positionally, as before
        return [float(len(x)) for x in c]

    def named_only(completions, answer):  # no **kwargs: only the names it takes
        return [float(c == a) for c, a in zip(completions, answer)]

    _, per = compute_rewards([positional, named_only, math_accuracy], None, PROMPTS, ["2", "5"], COLUMNS)
    assert per["positional"].tolist() == [1, 1] and per["named_only"].tolist() == [1, 0]
    assert per["math_accuracy"].tolist() == [1, 0]


@pytest.mark.parametrize("fn", [lambda completion: [0.0], lambda: [], lambda *, texts: [0.0]])
def test_a_signature_neither_way_is_refused_naming_both(fn):
    from common.tasks.rewards import call_style

    with pytest.raises(ValueError, match=r"write it as TRL's def f\(completions, \*\*kwargs\) .* or def "
                                         r"f\(prompts, completions, \*\*columns\)"):
        call_style(fn, "mine")
    with pytest.raises(RewardError, match="write it as TRL's"):
        compute_rewards([fn], None, PROMPTS, ["2", "5"], COLUMNS)


def test_a_reward_file_is_loaded_by_path_once(trl_rewards, tmp_path):
    first = get_reward_function(f"{trl_rewards}:reward_len")
    assert get_reward_function(f"{trl_rewards}:reward_len") is first  # not executed again
    with pytest.raises(ValueError, match="no such file"):
        get_reward_function(f"{tmp_path}/missing.py:fn")


def test_a_module_not_found_names_the_fix():
    with pytest.raises(ValueError) as info:
        get_reward_function("my_rewards_nowhere:fn")
    assert "give its file instead, e.g. path/to/my_rewards_nowhere.py:fn" in str(info.value)


def test_the_toy_trains_with_trl_rewards_from_a_file(in_toy_workdir, trl_rewards):
    """Two steps of the toy with TRL-style functions given by their file's path: each step's call gets the
    completion ids and the steps done before it."""
    from conftest import read_metrics, run_script

    import grpo
    from common.tasks.reward_files import load_file

    module = load_file(trl_rewards)
    module.CALLS.clear()
    funcs = ",".join(f"{trl_rewards}:{n}" for n in ("reward_len", "exact_answer", "recorder"))
    run = run_script(grpo, ["--preset", "toy", "--batch_size", "16", "--num_generations", "4",
                            "--micro_batch_size", "4", "--eval_steps", "0", "--total_steps", "2",
                            "--reward_funcs", funcs, "--run_name", "trl_rewards"])
    steps = [m for m in read_metrics(run) if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2], steps
    assert all(m["reward/reward_len/mean"] < 0 for m in steps), steps
    trained = [c for c in module.CALLS if c["prompts"] == 16]
    assert [c["step"] for c in trained] == [0, 1]
    assert all(len(c["ids"]) == 16 and all(isinstance(t, int) for ids in c["ids"] for t in ids)
               for c in trained)
    assert any(ids for c in trained for ids in c["ids"])  # real completions, not the trial call's
