"""The multiple-choice grader, `choice_accuracy`: the option letter a completion chose, compared
with the reference.

It reads ``\\boxed{C}``, "the answer is (C)", "Answer: C", "Choice_C" or "Option C", or the one
option whose text the answer is ("the answer is x^2/8"), with the options read from the prompt ("A.
x", "A: x", "(A) x"; see ``options_of``); a list of letters ("A, B, C or D") is no answer and scores
0. Registered by name and imported when a run or a benchmark asks for it
(common/tasks/reward_names.py BUILT_IN_MODULES); it reads boxes and answer sentences as the math
grader does
(common/tasks/math_grader.py).
"""

import re
from collections import deque

from common.tasks.math_grader import (
    _BOX_GAP,
    _CONTROL,
    _TEXT,
    _answer_after,
    _boxes,
    _prepared,
    _quick_verdict,
)
from common.tasks.rewards import register_reward, texts_of

# Multiple choice. The options are lines of the prompt: "A. x" (common/tasks/benchmark_sets.py
# format_choices), "A: x", "A) x", "(A) x", the first one perhaps after "Options:" (MMLU-Pro's
# prompt: "Options: A. x\nB. y").
LETTERS = "ABCDEFGHIJ"
_OPTION_LINE = re.compile(r"^[ \t]*+(?:(?i:answer[ \t]++)?(?i:options|choices)[ \t]*+:[ \t]*+)?"
                          r"(?:\(([A-J])\)|([A-J])[.:)])[ \t]++([^\n]*)", re.MULTILINE)
# Each pattern starts with a set of characters, and checks the word boundary before it with a
# lookbehind after it: a pattern that starts with "\b" or with a choice of words is tried at every
# position of the text, which took three times as long as these (1 MB: about 100 ms each). The most
# explicit pattern comes first; within a pattern the last match wins. Possessive quantifiers keep
# them linear in time.
_CHOICE_PATTERNS = [
    # "The answer is (C)", "Answer: C", "The answer is Choice_B", "answer: option (B)", "the correct
    # option is B" (not "each option:\nA. ..."), "The correct answer should be:\n\nG. ..." after
    # "the correct answer is: A" (MMLU-Pro deepseek-11304), "The answer is \( B \)." (gpt4o-7691)
    re.compile(r"[aAcCrRbBfF](?:(?<=[aA])(?i:nswer)\s*+(?i:is|:|(?:should|would)\s++be)"
               r"|(?<!\w[cCrRbBfF])"
               r"(?:(?<=[cC])(?i:orrect)|(?<=[rR])(?i:ight)|(?<=[bB])(?i:est)|(?<=[fF])(?i:inal))"
               r"\s++(?i:option|choice)\s++(?i:is))"
               r"[:*\s$]*+(?:\\[(\[]\s*+)?(?:(?i:option|choice)(?:[\s_]|\\_)*+)?"
               r"\(?\s*+([A-J])\b(?![.,']?\w)"),
    # "(C)", "Option B", "Choice_B", "Choice\_B" (Markdown's escaped underscore), "option (B)"
    # ("options A and B" is no choice)
    re.compile(r"[(oOcC](?:(?<=\()([A-J])\)"
               r"|(?<!\w[oOcC])(?:(?<=[oO])(?i:ption)|(?<=[cC])(?i:hoice))"
               r"(?:[ \t_]|\\_)*+([A-J])\b(?![.,']?\w))"),
    # a lone letter closing a sentence or line
    re.compile(r"([A-J])(?<!\w[A-J])\b(?=\s*(?:[.):*]|$))", re.MULTILINE),
]
# An enumeration of letters is no answer: "A, B, C or D", "(A), (B) or (C)", "A/B/C", "either B or
# C", "Option A or Option B". A policy that lists every letter would be paid whenever the letter
# read from the list (its first or its last) is the gold one. A letter read by the patterns above is
# one of a list when a separator alone parts it from another letter: _LIST_NEXT from the end of the
# letter, _LIST_PREV ending where it starts (searched within the _LIST_REACH characters before it;
# bounded quantifiers, so each check takes constant time). A space alone is no separator ("Choice_A
# Choice_B" reads B), and "_" may stand before a listed letter ("Choice_A, Choice_B").
_LIST_SEP = (r"[ \t]{0,3}(?:([,/&;])[ \t]{0,3}(?:((?i:or|and|nor))[ \t]{1,3})?"
             r"|((?i:or|and|nor))[ \t]{1,3})")
_LIST_OPEN = r"(?:(?i:option|choice)(?:[ \t_]|\\_){0,3})?[(*$]{0,3}[ \t]{0,2}"
_LIST_CLOSE = r"[ \t]{0,2}[)*$]{0,3}"
_LIST_NEXT = re.compile(_LIST_CLOSE + _LIST_SEP + _LIST_OPEN + r"([A-J])(?!\w)")
_LIST_PREV = re.compile(r"(?<![^\W_])([A-J])" + _LIST_CLOSE + _LIST_SEP + _LIST_OPEN + r"\Z")
_LIST_REACH = 60
# After "C, D" or "C and D" a word may follow: "The answer is C, D is wrong", "B and I think": a
# clause, not a list (but "A and B and C" is one).
_CLAUSE_AFTER = re.compile(r"[)*$]{0,3}[ \t]{1,3}(?!(?:or|and|nor)\b)[a-z]")
# What a completion that names the option's text writes after the marker: "the answer is x^2/8",
# "Answer: True, False"
_ANSWER_MARKER = re.compile(r"answer\s*+(?:is|:)", re.IGNORECASE)
_LINE_REST = re.compile(r"[:*\s]*+([^\n]{1,300})")
_OPTION_MARKUP = re.compile(r"\*\*|\$|\\[()\[\]]")


def options_of(prompt: str) -> dict[str, str]:
    """The options a prompt lists, letter -> text: its last run of option lines "A. ...", "B. ..."
    that starts at A (a few-shot prompt lists the options of every example; a question may hold
    lines such as "I. ..." or "C: ...")."""
    found = [(m[1] or m[2], m[3]) for m in _OPTION_LINE.finditer(prompt)]
    starts = [i for i, (letter, _) in enumerate(found) if letter == "A"]
    if not starts:
        return {}
    options = {}
    for letter, text in found[starts[-1] :]:
        if letter != LETTERS[len(options)]:
            break
        options[letter] = text
    return options


def _option_key(text: str) -> str:
    """An option's text as compared: without markup ("**", "$", "\\text{}"), spaces or a final
    period, in lower case."""
    text = _OPTION_MARKUP.sub("", _TEXT.sub(r"\1", text))
    return " ".join(text.split()).rstrip(".").strip().lower()


def _named_option(answer: str | None, options: dict[str, str]) -> str | None:
    """The letter of the one option whose text `answer` is ("x^2/8" for "B. $x^2/8$"), or None:
    equal once normalised (``_option_key``), or equal by the grader's comparisons that need no
    parsing (``_quick_verdict``: "0.50" for "0.5", "\\frac{1}{2}" for "\\dfrac12"); math-verify is
    not called, as it can run for long (see ``_Pool``)."""
    if not answer or len(answer) > 300:
        return None
    key = _option_key(answer)
    if not key:
        return None
    matches = set()
    for letter, text in options.items():
        if len(text) <= 300 and (key == _option_key(text)
                                 or _quick_verdict(*_prepared(answer, text))):
            matches.add(letter)
    return matches.pop() if len(matches) == 1 else None


def _marked_option(text: str, options: dict[str, str]) -> str | None:
    """The option whose text follows the last "the answer is" / "Answer:": the expression there (as
    ``extract_answer`` reads it), the sentence, or the rest of the line."""
    last = None
    # the end first, as in ``_marked_answer``
    for start in sorted({max(len(text) - 5000, 0), 0}, reverse=True):
        for last in _ANSWER_MARKER.finditer(text, start):
            pass
        if last:
            break
    if last is None:
        return None
    end = last.end()
    rest = _LINE_REST.match(text, end)
    candidates = [_answer_after(text, end, words_allowed=True)]
    if rest:
        candidates += [rest[1].split(". ")[0], rest[1]]
    for candidate in candidates:
        letter = _named_option(candidate, options)
        if letter:
            return letter
    return None


def _last_letter(pattern: re.Pattern, text: str, letters: str) -> tuple[str, int] | None:
    """The letter of the last match of `pattern` that is one of `letters`, and where it stands in
    `text` (``findall``, then ``finditer`` into a bounded deque for the position: a Python step per
    match made "A. " * 333,333 take three times as long)."""
    for back, found in enumerate(reversed(pattern.findall(text))):
        letter = found if isinstance(found, str) else "".join(found)
        if letter in letters:
            match = deque(pattern.finditer(text), maxlen=back + 1)[0]
            return letter, match.start(match.lastindex)
    return None


def _in_list(text: str, start: int, letters: str) -> bool:
    """Whether the letter at text[start] is one of an enumeration of letters ("A, B, C or D"):
    another of `letters` stands next to it with only a separator between them (not "C, D is wrong":
    a clause)."""
    after = _LIST_NEXT.match(text, start + 1)
    if after and after[4] in letters:
        joined_by_or = after[1] == "/" or any(word and word.lower() != "and"
                                              for word in (after[2], after[3]))
        if joined_by_or or not _CLAUSE_AFTER.match(text, after.end()):
            return True
    before = _LIST_PREV.search(text, max(start - _LIST_REACH, 0), start)
    return bool(before and before[1] in letters)


def _box_letter(text: str, letters: str) -> str | None:
    """The letter a box's content names ("C", "(C)", "\\text{C}", "C. x^2/8"); "" for a list of
    letters ("A, B")."""
    inner = _TEXT.sub(r"\1", text).strip().strip("()$*. ").strip()
    if inner and inner[0] in letters and (len(inner) == 1 or not inner[1].isalnum()):
        return "" if _in_list(inner, 0, letters) else inner[0]
    return None


def extract_choice(text: str, letters: str = LETTERS,
                   options: dict[str, str] | None = None) -> str | None:
    """The option letter a completion chose, or None.

    Looks, in order, for the last ``\\boxed{C}`` (also ``\\boxed{\\text{(C)}}``), "the answer is
    (C)" / "Answer: C" / "the answer is Choice_C" / "the correct option is C", then (with `options`,
    letter -> text, as ``options_of`` reads them from the prompt) a box or "the answer is ..." that
    holds one option's text instead of its letter, then the last "(C)" / "Option C" / "Choice C",
    then the last letter standing alone at the end of a sentence or line. Only letters in `letters`
    count, so "I" and "A" as words do not. None when the letter found is one of a list ("A, B, C or
    D", "either B or C", "\\boxed{A, B}": see ``_in_list``). A closed ``<think>`` block is ignored,
    as in ``extract_answer``, and so are control characters.
    """
    text = text.translate(_CONTROL)
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    boxes = _boxes(text)
    boxed = text[boxes[-1][1] : boxes[-1][2]] if boxes else None
    letter = _box_letter(boxed, letters) if boxed is not None else None
    if letter is not None:
        gap = text[boxes[-2][2] + 1 : boxes[-1][0]] if len(boxes) > 1 else ""
        if len(boxes) > 1 and len(gap) <= 40 and _BOX_GAP.fullmatch(gap):
            if _box_letter(text[boxes[-2][1] : boxes[-2][2]], letters) not in (None, letter):
                return None  # "\boxed{A}, \boxed{B}": boxes side by side, as a list
        return letter or None  # "" : "\boxed{A, B}"
    found = _last_letter(_CHOICE_PATTERNS[0], text, letters)
    if found:
        return None if _in_list(text, found[1], letters) else found[0]
    if options:
        letter = _named_option(boxed, options) if boxed is not None else None
        if letter and letter in letters:
            return letter
        letter = _marked_option(text, options)
        if letter and letter in letters:
            return letter
    for pattern in _CHOICE_PATTERNS[1:]:
        found = _last_letter(pattern, text, letters)
        if found:
            return None if _in_list(text, found[1], letters) else found[0]
    return None


@register_reward("choice_accuracy")
def choice_accuracy(prompts: list[str], completions: list, answer: list[str],
                    **_) -> list[float]:
    """1.0 when the completion picks the reference option letter, else 0.0.

    The valid letters, and the options' texts, are read from the option lines of the prompt ("A.
    ...", "A: ...", "(A) ...": ``options_of``; A-J if it has none); `answer` holds the letter ("C",
    or "(C)") or its index (2, as MMLU stores it).
    """
    rewards = []
    # text, or TRL's conversational form
    for p, c, a in zip(texts_of(prompts), texts_of(completions), answer):
        options = options_of(p)
        gold = LETTERS[a] if isinstance(a, int) else str(a).strip().strip("()").strip()[:1].upper()
        rewards.append(float(extract_choice(c, "".join(options) or LETTERS, options) == gold))
    return rewards
