"""The math grader: reads a completion's final answer and compares it with the reference, within a
time limit.

``math_accuracy`` reads the model's final answer (``extract_answer``: boxes, "the final answer is",
``#### x``, then the trailing expression) and compares it with the dataset answer using math-verify,
so that ``\\frac{1}{2}``, ``0.5`` and ``\\dfrac12`` all count as the same answer. Each rule below
names the output that motivated it (a ProcessBench or ReasonEval id is a row of
tests/data/grader_realdata.jsonl.gz). Policies: an unsimplified but equal value counts
(``\\frac{6}{8}`` for ``\\frac34``); a percent sign is dropped on both sides (``17.5\\%`` =
``17.5``, not ``0.175``), and a plain fraction also matches a percent reference (``0.625`` for
``62.5%``); a bare list (``2, 4, 3``) is a set unless the prompt asks for an ordered
pair/triple/tuple, an order, or a list of named values ("T(10), T(11) and T(12)"); an inequality
matches an interval reference; several boxes side by side, or in one sentence joined by "and", are
one answer, a set; an answer that is wholly an English number ("twelve", "two hundred and five",
"one half") is read as that number, and one in words is compared without case; only the final answer
counts. math-verify runs in worker processes with a hard time limit per sample (``TIME_LIMIT_S``): a
sample over it gets reward 0 and is counted as ``math_accuracy/timeouts``. Multiple choice,
``choice_accuracy``, is common/tasks/choice_grader.py. The evaluation package (evals/) grades with
these same functions.
"""

import atexit
import functools
import logging
import math
import os
import re
import subprocess
import sys
import threading
import time
import unicodedata
import warnings
from collections import deque
from decimal import Decimal
from fractions import Fraction
from multiprocessing.connection import Connection, Pipe, wait
from pathlib import Path

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from common.tasks.rewards import Rewards, register_reward, texts_of

# ---------------------------------------------------------------------------
# Text as models write it: Unicode and LaTeX spellings of the same answer
# ---------------------------------------------------------------------------

# "x²" -> "x^2" must come before NFKC, which would make it "x2"; "√2"
# -> "\sqrt2", "−3" (U+2212) -> "-3".
_UNICODE_MATH = str.maketrans(
    {**{c: f"^{d}" for d, c in enumerate("⁰¹²³⁴⁵⁶⁷⁸⁹")}, "⁻": "^-", "−": "-", "–": "-",
     "×": r"\times ", "·": r"\cdot ", "÷": r"\div ", "π": r"\pi ", "∞": r"\infty ", "√": r"\sqrt",
     "≤": r"\le ", "≥": r"\ge ", "≠": r"\ne ", "°": r"^\circ ", "±": r"\pm ", "∓": r"\mp ",
     "\u00a0": " ", "\u2009": " ", "\u202f": " "})
# "½" -> "\frac{1}{2}" in the same table (NFKC would give "1⁄2"), and "3½" ->
# "3+\frac{1}{2}" (NFKC: "31⁄2"): one C-level pass each, as a 1 MB completion of
# "½" took 0.9 s with a Python call per match.
_VULGAR = [chr(c) for c in [*range(0xBC, 0xBF), *range(0x2150, 0x215F)]]
_UNICODE_MATH.update(str.maketrans({
    c: r"\frac{%s}{%s}" % tuple(unicodedata.normalize("NFKC", c).split("\u2044"))
    for c in _VULGAR}))
_MIXED_NUMBER = re.compile(rf"(?<=\d)\s*+(?=[{''.join(_VULGAR)}])")


def _ascii_math(text: str) -> str:
    """Unicode digits, fractions and symbols as LaTeX: "５" -> "5", "½" -> "\\frac{1}{2}", "√2" ->
    "\\sqrt2"."""
    if text.isascii():
        return text
    text = _MIXED_NUMBER.sub("+", text).translate(_UNICODE_MATH)
    return unicodedata.normalize("NFKC", text).replace("\u2044", "/")


# ---------------------------------------------------------------------------
# Answer extraction (linear time, on at most READ_CHARS characters)
# ---------------------------------------------------------------------------

_BOX_TOKEN = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")


def _boxes(text: str) -> list[tuple[int, int, int]]:
    """(start, content start, end) of every complete outermost ``\\boxed{...}`` / ``\\fbox{...}``,
    in order.

    One pass with a stack: rescanning to the end for each box is quadratic, and a completion with
    thousands of unclosed ``\\boxed{`` took seconds. A box whose braces never close (cut off by the
    length limit) is skipped.
    """
    first = min((i for i in (text.find("\\boxed"), text.find("\\fbox")) if i >= 0), default=-1)
    if first < 0 or text.rfind("}") < first:  # no box, or none closed ("\boxed{" 140,000 times)
        return []
    depth = 0
    open_boxes = []
    found = []
    for token in _BOX_TOKEN.finditer(text, first):
        if token[0] == "}":
            depth = max(depth - 1, 0)
            if open_boxes and open_boxes[-1][0] == depth:
                _, start, content = open_boxes.pop()
                # a box inside this one: the outer box is the answer
                while found and found[-1][0] > start:
                    found.pop()
                found.append((start, content, token.start()))
        else:
            if token[0] != "{":
                open_boxes.append((depth, token.start(), token.end()))
            depth += 1
    return found


def _last_boxed(text: str) -> str | None:
    """Content of the last complete outermost ``\\boxed{...}``/``\\fbox{...}``, or None."""
    found = _boxes(text)
    return text[found[-1][1] : found[-1][2]] if found else None


# Boxes separated only by this are one answer: "$\boxed{-1}$ and
# $\boxed{-9}$", "x = \boxed{2}, x = \boxed{3}".
_BOX_GAP = re.compile(
    r"(?:\s|[$,;.]|\\[()\[\],;! ]|\\quad|\band\b|\bor\b|\\text\{\s*(?:and|or)\s*\}|"
    r"(?<![a-zA-Z])[a-zA-Z](?:_\w)?\s*=)*")


# Boxes of the last sentence are one answer too when "and" and a verb join them, the parts of a
# question that asks for two: "The maximum ... is \(\boxed{3}\), and the minimum possible number ...
# is \(\boxed{1}\)." (olympiadbench-806, reference "1,3"); not "first \boxed{1}, then \boxed{2}".
_GAP_SENTENCE_END = re.compile(r"\n|[.!?;](?:\s|$)")


def _final_boxes(text: str) -> str | None:
    """The last non-empty box, joined with the boxes just before it that only ``_BOX_GAP``
    separates, or that stand in the same sentence (as a set)."""
    # "\boxed{}" holds no answer (omnimath-660)
    found = [box for box in _boxes(text) if text[box[1] : box[2]].strip()]
    if not found:
        return None
    group = [found[-1]]
    for box in reversed(found[:-1]):
        gap = text[box[2] + 1 : group[0][0]]
        side_by_side = len(gap) <= 40 and _BOX_GAP.fullmatch(gap)
        same_sentence = (len(gap) <= 150 and not _GAP_SENTENCE_END.search(gap)
                         and re.search(r"\band\b", gap) and _ANCHOR.search(gap))
        if not (side_by_side or same_sentence):
            break
        group.append(box)
    answers = list(dict.fromkeys(text[content:end].strip() for _, content, end in reversed(group)))
    return ", ".join(answers)


# An expression as written inline: numbers, LaTeX commands, operators, \text{...} units and single
# letters, but no English word of two letters or more ("34 hours" -> "34", "2:00 pm" -> "2:00").
_EXPRESSION = re.compile(
    r"(?:\\(?:text|textbf|mbox|mathrm)\s*\{[^{}\n]*\}|\\[a-zA-Z]+|\\[()\[\],;!{}% ]"
    r"|[0-9.,+\-*/^_=()\[\]{}<>|!%$€£¥₹:'\t ]|(?<![a-zA-Z])[a-zA-Z](?![a-zA-Z]))+")
_MATH_SPAN = {"$$": "$$", "$": "$", "\\(": "\\)", "\\[": "\\]"}
_SENTENCE_END = re.compile(r"\.(?=\s|$)|\n|,\s+(?=[a-zA-Z]{2})")
_FILLER = re.compile(r"^(?:(?:therefore|thus|then|so|simply|just|about|approximately|exactly"
                     r"|equal to|now)\b[\s,]*)+", re.IGNORECASE)
# "\(" "\[" opening, "\)" "\]" closing the answer
_DELIMITERS = re.compile(r"^(?:\\[(\[]\s*)+|(?<!\s)(?<!\\[)\]])(?:\s*\\[)\]])+[\s.,;:]*$")
# "5 a" of "5 a day", "5 m/s" (GSM8K: "1200/240 = 5 m/s"); after a number only: not "\cot x"
# (ReasonEval prm800k-66), not "2 + T" (ProcessBench olympiadbench-571 was read as 2)
_LONE_LETTERS = re.compile(r"(?<=[\d}%])(?:\s+[a-zA-Z](?:/[a-zA-Z])?)+\s*$")


def _tidy(answer: str) -> str:
    """Strip what surrounds an answer in prose: bold, "a.m.", a lone trailing letter ("5 a day"),
    and a dangling operator ("$7200/year" -> "$7200/", "27-liter" -> "27-", "%95")."""
    # "x = 9 \)", "= 45\]": the run reaches the span's end
    answer = _DELIMITERS.sub("", answer.strip())
    answer = re.sub(r"(?<!\s)\s*[ap]\.m\.?$", "", answer.strip().strip("*").strip())
    answer = _LONE_LETTERS.sub("", answer).rstrip(".,;: ").strip()
    answer = answer.rstrip("/*+-=<>:^_(,").lstrip("%:,; ").strip()
    if len(answer) > 1 and answer[0] == answer[-1] == "$":  # "$\sqrt{17}$" from prose
        answer = answer.strip("$").strip()
    return answer.replace(",", "") if _THOUSANDS.fullmatch(answer) else answer  # "1,234" -> "1234"


def _answer_after(text: str, start: int, words_allowed: bool) -> str | None:
    """The answer written right after a marker such as "The final answer is" (a bounded window).

    A math span ($...$, \\(...\\), \\[...\\]) is taken whole; otherwise the rest of the sentence,
    cut to its leading expression. An answer in words ("twelve", "Monday") is kept only after a
    phrase marker (`words_allowed`): after ``####`` or ``A:`` a word means a Markdown heading, "####
    For \\(T = 3\\):".
    """
    window = text[start : start + 500]
    lead = re.match(r"[\s*:]*", window)
    # the marker ends a paragraph that does not hold the answer
    if window[: lead.end()].count("\n") > 2:
        return None
    rest = window[lead.end() :]
    for opening, closing in sorted(_MATH_SPAN.items(), key=lambda kv: -len(kv[0])):
        if rest.startswith(opening):
            # not the "\$" of "$\$5$"
            end = re.compile(r"(?<!\\)" + re.escape(closing)).search(rest, len(opening))
            if end and end.start() > len(opening):
                return _tidy(rest[len(opening) : end.start()]) or None
            break
    # "# Answer\n\n12*pi": a line, one token
    token = re.match(r"\S+(?=[ \t]*(?:\n|$))", rest) if words_allowed else None
    if token:
        return _tidy(token[0]) or None
    end = _SENTENCE_END.search(rest)
    sentence = rest[: end.start()] if end else rest
    if words_allowed:  # "The answer is therefore 3."
        sentence = _FILLER.sub("", sentence)
    expression = _EXPRESSION.match(sentence)
    if expression is None or not _tidy(expression[0]):
        if not words_allowed:
            return None
        # A sentence that states the answer: "**Answer:** Verna received $7.00 in change."
        # (ProcessBench gsm8k-299), "The probability that Emile's set contains exactly 3 aces, given
        # ..., is \(1\)." (olympiadbench-600): its value as in the trailing-expression rule; an
        # answer in words ("Monday", "twelve") as it is.
        stop = _SENTENCE_STOP.search(rest)
        sentence = rest[: stop.start()] if stop else rest
        stated = _sentence_answer(sentence) if _has_digit(sentence) else None
        return stated or _tidy(sentence) or None
    # "the final answer is 15 gallons * 8 pints / gallon = 120 pints" (GSM8K)
    if "=" in sentence[expression.end() :]:
        return _sentence_answer(sentence) or _tidy(expression[0])
    return _tidy(expression[0])


# Final-answer phrases as models write them (the last one in the text wins):
#   Minerva: "Final Answer: The final answer is $\frac{4}{35}$. I hope it is correct."
#   Qwen / DeepSeek: "**Final Answer**\n\n$\frac{4}{35}$", "The answer is 18.", "**Answer:** 18"
#   GSM8K: "#### 18" (but not a heading "#### For \(T = 3\):"); GSM8K few-shot: "A: 18"
#   PRM800K (GPT-4): "# Answer\n\n12*pi", "# Answer\n\nHillary has 7 nickels."
#     (ReasonEval prm800k-12, -287)
_MARKER = re.compile(
    r"(?P<phrase>(?i:final\s+answer(?:\s*\**\s*(?:is|:))?|\banswer\s+is|\banswer\s*\**\s*:)|"
    r"^[ \t]*\#[ \t]*Answer[ \t]*$)|^[ \t]*(?P<line>####|A:)", re.MULTILINE)


def _marked_answer(text: str) -> str | None:
    """The answer after the last final-answer marker that is followed by one, or None.

    The end of the text is searched first: the answer is there, and a 1 MB completion need not be
    read twice.
    """
    for start in sorted({max(len(text) - 5000, 0), 0}, reverse=True):
        for marker in reversed(list(_MARKER.finditer(text, start))):
            answer = _answer_after(text, marker.end(), words_allowed=marker["phrase"] is not None)
            if answer:
                return answer
    return None


_SENTENCE_STOP = re.compile(r"\n|\.(?:\s|$)")
_CALCULATOR = re.compile(r"<<[^<>\n]*>>")  # GSM8K's calculator annotations "<<48/2=24>>"
_ROUNDING = re.compile(r"\brounds?(?: up| down)? to\b")
# Verbs that state an amount. A modal only with the verb after it and a number next: "Ms. Alice can
# grade 407 papers in 11 hours", "It would take 15 hours to clean 45 rooms", "they will last 4
# weeks" (GSM8K reference solutions that gave 11, 45, 40), but not "2007 can divide evenly into \(
# 2007! \) up to 9 times" (ProcessBench omnimath-803). Not after "to": "to spend 5 dollars on 3
# toys", "Sally will need 5844 square inches ... to make the tablecloth and 8 napkins", "he'll need
# 1 more to make the plants 12" (GSM8K reference solutions) state no answer.
_ANCHOR = re.compile(
    r"=|(?<!\bto )\b(?:is|are|was|were|be|equals?|makes?|gives?|gets?|has|have|had|total(?: of)?|"
    r"rounds?(?: up| down)? to|(?:will|would|can|could|must|should)\s+[a-z]+(?=\s+\$?\d)|"
    r"needs?|needed|takes?|took|spends?|spent|costs?|pays?|paid|saves?|saved|earns?|earned|weighs?|"
    r"last)\b")
# "$118 000", "650 000/2 = 325 000 cars each" (GSM8K, reference
# 325,000); not "12 200-kilobyte videos"
_SPACED_THOUSANDS = re.compile(r"(?:\$\s*|(?<![\d.]))\d{1,3}(?: \d{3})+(?![\d\-])")
# "12 200-kilobyte videos": 12, then another number
_NEXT_QUANTITY = re.compile(r"(?<=[\d}])\s+(?=[$\d])")


def _has_digit(s: str) -> bool:
    return any(c.isdigit() for c in s)


def _run_value(run: str) -> str:
    """The value an expression in prose states: "9 * 2 = $18" -> $18, "20 = A" -> 20, "50 < 52" ->
    50 (a comparison that justifies the answer), "Week 3:210" -> 210 (but "2:00" stays a time), "2
    $10 bills" -> 2."""
    if re.search(r"\d\s*[<>]", run):
        run = re.split(r"[<>]", run)[0]
    # a bare "x = \\text{a}": no value
    run = ([part for part in run.split("=") if _has_digit(part)] or [""])[-1]
    if ":" in run and not re.search(r"\d{1,2}:\d{2}(?!\d)", run):
        run = run.rsplit(":", 1)[1]
    if not _SPACED_THOUSANDS.search(run):
        run = _NEXT_QUANTITY.split(run.strip())[0]
    return _tidy(run)


def _trailing_expression(text: str) -> str | None:
    """The answer of a completion with no box and no marker: the value its last sentence with a
    digit states (``_sentence_answer``)."""
    text = _CALCULATOR.sub("", text)
    last_digit = max(text.rfind(d) for d in "0123456789")
    if last_digit < 0:
        return None
    start = max(text.rfind("\n", 0, last_digit), text.rfind(". ", 0, last_digit) + 1,
                last_digit - 2000)
    stop = _SENTENCE_STOP.search(text, last_digit)
    sentence = text[start : stop.start() if stop else len(text)]
    return None if _NEGATED.search(sentence) else _sentence_answer(sentence)


# A last sentence that denies is no answer: a solution cut off while trying values, "So, \\( x = 14
# \\) and \\( y = 15 \\) is not a solution." (ProcessBench math-381; reference 15), or one that
# gives up, "... cannot be determined" (omnimath-69).
_NEGATED = re.compile(r"\b(?:is|are|was|were)\s*(?:not|n't)\s+(?:a |an |the )?"
                      r"(?:solution|valid|correct|possible|true|answer)"
                      r"|\bcannot be (?:determined|found)|\bnot enough information", re.IGNORECASE)
# a value restated as a percent: "= 0.60 or 60% off" (GSM8K)
_OR_PERCENT = re.compile(r"or\s+(\d[\d.]*\s*%)")
_IS_THE_ANSWER = re.compile(
    r"(?<![\w.])(\$?-?\d[\d,.]*)\s+is\s+the\s+(?:final\s+|correct\s+)?answer\b", re.IGNORECASE)
_BOLD = re.compile(r"\*\*([^*\n]+)\*\*")
_LIST_GAP = re.compile(r"\s*,?\s*(?:and|or)\s*")
_LIST_ITEM = re.compile(r"\s*(?:(?P<name>[a-zA-Z](?:_\w)?)\s*=\s*)?[^=]*")


def _same_answer_list(runs: list[re.Match]) -> str | None:
    """ "\\(n = 5\\) and \\(n = 15\\)", "\\(-1, 0,\\) and \\(1\\)": math spans joined by "and"/"or"
    that give values of one unknown (or bare values) are one answer, a list (ProcessBench
    olympiadbench-713, -759, omnimath-982). Chained steps "\\(4 + 4 = 8\\) and \\(8 \\times 2 =
    16\\)" are not: their left sides are not one name."""
    if len(runs) < 2 or not all("\\(" in run[0] for run in runs):
        return None
    items = [item for run in runs for item in _split_list(re.sub(r"\\[()]", " ", run[0]))
             if item.strip()]
    matches = [_LIST_ITEM.fullmatch(item) for item in items]
    names = {m["name"] for m in matches if m} if items else {"?"}
    if len(names) != 1 or not all(_LIST_ITEM.fullmatch(item) for item in items):
        return None
    values = [_run_value(item) for item in items if _has_digit(item)]
    return ", ".join(values) if len(values) > 1 and all(values) else None


def _sentence_answer(sentence: str) -> str | None:
    """The answer a sentence states: the expression after its last "=" or verb like "is".

    LaTeX-aware ("$\\frac{4}{35}$" is 4/35, not 35; "16\\pi" is not 16). A number in bold wins:
    "there are **19** integers from 1 to 100" (ProcessBench omnimath-793, math-943). Else the first
    expression after the last "=", rounding or verb anchor ("the total is 34 hours in 4 weeks" ->
    34, "= 16.66%, which rounds up to 17%" -> 17%), in that order of preference ("= 200 dogs left
    after 60 were adopted" -> 200), taking the next kind when none follows the last anchor of a kind
    ("There are 1164 times \\(h:m:s\\) ... the equation \\(h + m = s\\)", omnimath-879); an "="
    inside a math span before the verb is not an anchor ("The range of \\(f(x) = \\arctan x\\) is
    \\([-\\frac{\\pi}{2}, \\frac{\\pi}{2}]\\)", math-837). Else the last expression; then
    ``_run_value``.
    """
    # "confirming that 80 is the answer" (GSM8K reference, answer 80)
    stated = _IS_THE_ANSWER.search(sentence)
    if stated:
        return _run_value(stated[1]) or None
    bold = [b[1] for b in _BOLD.finditer(sentence) if _has_digit(b[1])
            and _EXPRESSION.fullmatch(b[1].strip())]
    if bold:
        return _run_value(bold[-1]) or None
    runs = [r for r in _EXPRESSION.finditer(sentence) if _has_digit(r[0])]

    # the last anchor with an expression after it
    def last_followed(positions: list[int]) -> int | None:
        return next((p for p in reversed(positions) if runs and runs[-1].end() > p
                     and _has_digit(sentence[p : runs[-1].end()])), None)

    equals = sentence.rfind("=") + 1 if "=" in sentence else None
    verbs = [a.end() for a in _ANCHOR.finditer(sentence) if a[0] != "="]
    verb = last_followed(verbs) if equals else None
    if equals and verb and verb > equals and "\\)" in sentence[equals:verb]:
        equals = None
    rounding = [a.end() for a in _ROUNDING.finditer(sentence)]
    kinds = (rounding[-1] if rounding else None, equals, verbs[-1] if verbs else None)
    for anchor in (kind for kind in kinds if kind is not None):
        after = [i for i, r in enumerate(runs) if r.end() > anchor
                 and _has_digit(sentence[anchor : r.end()])]
        if after:
            first = last = after[0]
            while first > 0 and _LIST_GAP.fullmatch(
                    sentence[runs[first - 1].end() : runs[first].start()]):
                first -= 1
            while last + 1 < len(runs) and _LIST_GAP.fullmatch(
                    sentence[runs[last].end() : runs[last + 1].start()]):
                last += 1
            listed = _same_answer_list(runs[first : last + 1])
            run = runs[after[0]]
            # "= 0.60 or 60% off" (GSM8K, answer 60)
            restated = _OR_PERCENT.match(sentence, run.end())
            if restated:
                return _tidy(restated[1])
            return listed or _run_value(sentence[max(anchor, run.start()) : run.end()]) or None
        # "or 20 = A": the last expression
        if anchor != equals or any(r.start() < equals <= r.end() for r in runs):
            break
    return _run_value(runs[-1][0]) or None if runs else None


# Only the end of a completion is read: a final answer is at the end, the longest of 3,312 real
# solutions is 7,642 characters, and every rule is linear but a 1 MB completion of "½" (11 MB once
# written as LaTeX) took 2 s.
READ_CHARS = 100_000


# Control characters a tokenizer can decode (NUL, escape, ...): "\boxed{3\x00}" is the answer 3. Tab
# and newline stay.
_CONTROL = dict.fromkeys([*range(0, 9), *range(11, 32), 127])


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, or None when it gives none.

    Looks, in order, for the last ``\\boxed{}`` (with boxes side by side joined as a set), the last
    final-answer marker ("The final answer is", "Answer:", ``#### x``, ...), then the trailing
    expression (``_trailing_expression``). Text inside a closed ``<think>...</think>`` block is
    ignored: numbers from the scratch work there are not the answer; of the rest, the last
    ``READ_CHARS`` characters are read, control characters other than tab and newline dropped.
    """
    if "</think>" in text:
        text = text.rsplit("</think>", 1)[1]
    text = _ascii_math(text[-READ_CHARS:].translate(_CONTROL))
    boxed = _final_boxes(text)
    if boxed is not None:
        return boxed.strip()
    # "25 + 60 = \boxed{}": the answer's place is empty, and the expression before "=" is the
    # question restated, not its answer (a policy learned to write exactly this).
    if _EMPTY_BOX_AFTER_EQUALS.search(text):
        return None
    return _marked_answer(text) or _trailing_expression(text)


_EMPTY_BOX_AFTER_EQUALS = re.compile(
    r"=[ \t]*+(?:\$|\\[(\[])?[ \t]*+\\(?:boxed|fbox)[ \t]*+\{[ \t]*+\}")


def _number_text(value: int | float) -> str:
    """An int or float reference as digits: 3 -> "3", 2.0 -> "2", 1e-07 -> "0.0000001"."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return format(Decimal(repr(value)), "f") if isinstance(value, float) else str(value)


def extract_gold(answer: str | int | float) -> str:
    """The reference answer in a dataset's answer column.

    MATH stores a full solution ending in ``\\boxed{}``, GSM8K a solution ending in
    ``#### 42``; other datasets store the bare answer, as text or as a number (a JSON
    integer, an all-digit CSV column). ``None`` is for the caller (``math_accuracy``) to handle.
    """
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        return _number_text(answer)
    answer = _ascii_math(str(answer))
    boxed = _last_boxed(answer)
    if boxed is not None:
        return boxed.strip()
    if "####" in answer:
        return _tidy(answer.rsplit("####", 1)[1].strip().split("\n", 1)[0])
    return answer.strip()


# ---------------------------------------------------------------------------
# Normalisation: spellings math-verify reads wrongly or not at all
# ---------------------------------------------------------------------------

_EXTRACTION_CONFIG = [LatexExtractionConfig(), ExprExtractionConfig()]
# "\text {cm}" too
_TEXT = re.compile(r"\\(?:text|textbf|textit|mbox|mathrm|mathbf)\s*\{([^{}]*)\}")
# "5\text{ cm}", and "166 \, \text{cm}^2" (ProcessBench olympiadbench-793: the squared unit was kept
# and 166 rejected)
_TRAILING_UNIT = re.compile(
    r"(?<=[^\s{])\s*\\(?:text|mbox|mathrm)\s*\{\s*[a-zA-Z][^{}]*\}(?:\^\{?[23]\}?)?$")
# Matches start only where a run of spaces starts ((?<!\s)): "1" + 200,000
# spaces + "x" took minutes otherwise.
_PERCENT = re.compile(r"(?<!\s)\s*(?:\\?%|\\text\{\s*%\s*\}|(?<=\s)percent)$")
# Spacing commands, but not the row break "\\" of a matrix: in "a \\ b" the "\ " was read as a space
# and the rows merged, so every pmatrix answer written with spaces was rejected (ProcessBench
# math-552, math-595).
_SPACING = re.compile(r"\\\\|\\[,;:! ]|\\(?:left|right|displaystyle)(?![a-zA-Z])|~")
# Words that join the items of one answer: "(27, 20, 13) \text{ and } (18, 20, 22)"
# (olympiadbench-630), and a qualifier after it, "\frac{\pi}{6} + k\pi, ... \text{ for } k \in
# \mathbb{Z}" (olympiadbench-888).
_TEXT_AND = re.compile(r"(?<!\s)\s*\\text\s*\{\s*(?:and|or)\s*\}\s*")
_QUALIFIER = re.compile(r"(?<![\s,])(?<!\\quad)(?:\s|,|\\quad)*\\text\s*\{\s*(?:for|where)\b.*$")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:(?:,|\{,\})\d{3})+(?:\.\d+)?")
_CURRENCY = str.maketrans("", "", "$€£¥₹")
_PLAIN_NUMBER = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")


def _clean(answer: str) -> str:
    """One spelling per answer before any comparison.

    ``\\text {square inches}`` is a unit (a reference "8\\sqrt{3}\\text { square inches}" rejected
    "8\\sqrt{3}"); "17.5\\%" is 17.5 (math-verify read it as 0.175 and rejected 17.5, yet accepted
    25 for "25\\%"); ``\\textbf{(073)}`` is 073; "1,234" and "1{,}234" are 1234.
    """
    s = _ascii_math(answer).replace("\\$", "").strip().strip("$").strip()
    s = _SPACING.sub(lambda m: m[0] if m[0] == "\\\\" else "", s)
    # "12*pi", PRM800K's ASCII (ReasonEval prm800k-12)
    s = re.sub(r"(?<=[\d*\s])pi\b|^pi\b", r"\\pi", s)
    # "\boxed{\15}": the "$" of "\$15" lost (ProcessBench gsm8k-329)
    s = re.sub(r"^\\(?=\d)", "", s)
    if "\\text" in s:
        s = _TEXT_AND.sub(", ", s)
        qualifier = _QUALIFIER.search(s)
        if qualifier and qualifier.start() > 0:
            s = s[: qualifier.start()]
    # "f(y) = 1" is the function 1 (olympiadbench-814)
    s = re.sub(r"^[a-zA-Z]\(\s*[a-zA-Z]\s*\)\s*=(?!=)", "", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for opening, closing in (("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(opening) and s.endswith(closing):
            s = s[len(opening) : -len(closing)]
    s = _TRAILING_UNIT.sub("", s.strip().rstrip("."))
    s = _PERCENT.sub("", _TEXT.sub(r"\1", s).strip())
    s = s.strip().rstrip(".").strip()
    if re.fullmatch(r"\(\s*-?[\d.]+\s*\)", s):  # "(073)": an answer choice written in parentheses
        s = s[1:-1].strip()
    if _THOUSANDS.fullmatch(s):
        s = s.replace("{,}", "").replace(",", "")
    # "2:00" (pm) is the hour 2
    s = re.sub(r"^(\d{1,2}):00$", r"\1", s.translate(_CURRENCY).strip())
    return s


def _plain_number(s: str) -> Fraction | None:
    """The exact value of a plain decimal ("047", "27.0", "-3.5"), else None."""
    return Fraction(s) if _PLAIN_NUMBER.fullmatch(s) else None




# Numbers written in English words. math-verify reads a word as a product of symbols
# (twelve -> E*E*l*t*v*w), so an answer that is wholly a number phrase is turned into
# digits before the comparison; one with anything else in it ("twelve apples", "a
# dozen", "nineteen ninety") is left as it is.
_SMALL = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
          "fifteen sixteen seventeen eighteen nineteen").split()
_TENS = "twenty thirty forty fifty sixty seventy eighty ninety".split()
_WORD_VALUE = {w: i for i, w in enumerate(_SMALL)} | {w: 20 + 10 * i for i, w in enumerate(_TENS)}
# "halve" with an "s" is the plural "halves"
_DENOMINATOR = {"half": 2, "halve": 2, "third": 3, "quarter": 4, "fourth": 4, "fifth": 5,
                "sixth": 6, "seventh": 7, "eighth": 8, "ninth": 9, "tenth": 10}
_BELOW_100 = (rf"(?:(?:{'|'.join(_TENS)})(?:[ -](?:{'|'.join(_SMALL[1:10])}))?"
              rf"|{'|'.join(_SMALL[1:])})")
_BELOW_1000 = rf"(?:(?:{'|'.join(_SMALL[1:10])}) hundred(?: (?:and )?{_BELOW_100})?|{_BELOW_100})"
# "two thousand and twenty-six", "negative three", "two thirds", "a half"
_NUMBER_PHRASE = re.compile(
    rf"(?P<sign>(?:negative|minus) )?"
    rf"(?:(?P<integer>zero|{_BELOW_1000}(?: thousand(?: (?:and )?{_BELOW_1000})?)?)"
    rf"|(?P<numerator>a|{_BELOW_100}) (?P<denominator>{'|'.join(_DENOMINATOR)})s?)")


def _number_value(phrase: str) -> int:
    """The value of an integer phrase _NUMBER_PHRASE accepted: "two hundred and five" -> 205."""
    total = current = 0
    for word in re.split("[ -]", phrase):
        if word == "hundred":
            current *= 100
        elif word == "thousand":
            total = total + 1000 * current
            current = 0
        elif word != "and":
            current += _WORD_VALUE[word]
    return total + current


def _words_to_number(answer: str) -> str | None:
    """ "Twenty-five" -> "25", "\\text{negative three}" -> "-3", "two thirds" -> "2/3"; None unless
    the whole answer is one English number (zero to 999,999, or a count of halves to tenths)."""
    text = " ".join(_TEXT.sub(r"\1", answer).replace("$", "").strip().rstrip(".").lower().split())
    match = _NUMBER_PHRASE.fullmatch(text)
    if match is None:
        return None
    sign = "-" if match["sign"] else ""
    if match["integer"]:
        return sign + str(_number_value(match["integer"]))
    numerator = 1 if match["numerator"] == "a" else _number_value(match["numerator"])
    return f"{sign}{numerator}/{_DENOMINATOR[match['denominator']]}"


_LESS = r"(?:<|\\le(?:q|qslant)?(?![a-zA-Z]))"
_GREATER = r"(?:>|\\ge(?:q|qslant)?(?![a-zA-Z]))"
_BETWEEN = re.compile(
    rf"(?P<a>[^<>=]+?)\s*(?P<lo>{_LESS})\s*[a-zA-Z]\s*(?P<hi>{_LESS})\s*(?P<b>[^<>=]+)")
_ONE_SIDED = re.compile(
    rf"[a-zA-Z]\s*(?:(?P<less>{_LESS})|(?P<greater>{_GREATER}))\s*(?P<a>[^<>=]+)")


def _as_interval(pred: str) -> str:
    """ "\\frac{1}{2} \\leq x \\leq 8" -> "[\\frac{1}{2}, 8]", "k < -5" -> "(-\\infty, -5)": the
    inequality a reference states as an interval (ProcessBench olympiadbench-619, -710); math-verify
    compared them as unequal."""
    m = _BETWEEN.fullmatch(pred)
    if m:
        return f"{'(' if m['lo'] == '<' else '['}{m['a']}, {m['b']}{')' if m['hi'] == '<' else ']'}"
    m = _ONE_SIDED.fullmatch(pred)
    if m:
        strict = (m["less"] or m["greater"]) in "<>"
        if m["less"]:
            return f"(-\\infty, {m['a']}{')' if strict else ']'}"
        return f"{'(' if strict else '['}{m['a']}, \\infty)"
    return pred


def _is_interval(s: str) -> bool:
    """ "(a, b]", "[0, \\infty)": bracketed, with a comma inside (a test, not a regex: "(1, " * 4000
    made ``[\\[(].*,.*[\\])]`` quadratic)."""
    return len(s) > 2 and s[0] in "[(" and s[-1] in "])" and "," in s[1:-1] and "\n" not in s


def _prepared(pred: str, gold: str) -> tuple[str, str]:
    pred = _clean(pred)
    gold = _clean(gold)
    if _is_interval(gold) and not _is_interval(pred):
        pred = _as_interval(pred)
    return _words_to_number(pred) or pred, _words_to_number(gold) or gold  # "twelve" -> "12"


def _percent_as_fraction(pred: str, gold: str, prepared: tuple[str, str]) -> bool:
    """Whether a plain number is the fraction a percent reference means: 0.625 for "62.5%"
    (ProcessBench olympiadbench-607: the probability asked for, written as 0.625). A percent written
    as such stays its number ("17.5\\%" = 17.5, see ``_clean``); the fraction is accepted only when
    the answer has no percent sign."""
    gold_text = _TEXT.sub(r"\1", gold).strip().strip("$")
    if not _PERCENT.search(gold_text) or "%" in pred or "percent" in pred:
        return False
    pred_value = _plain_number(prepared[0])
    gold_value = _plain_number(prepared[1])
    return pred_value is not None and gold_value is not None and pred_value * 100 == gold_value


_WORDS = re.compile(r"[a-zA-Z]{2,}(?: [a-zA-Z]+)*")  # an answer in words: compared without case


def _quick_verdict(pred: str, gold: str) -> bool | None:
    """The verdict when no parsing is needed (most GSM8K-style answers), else None."""
    if not pred:
        return False
    if pred.replace(" ", "") == gold.replace(" ", ""):
        return True
    # "East" for "\\text{east}" (ReasonEval prm800k-89)
    if _WORDS.fullmatch(pred) and _WORDS.fullmatch(gold):
        return pred.lower() == gold.lower()
    pred_value = _plain_number(pred)
    gold_value = _plain_number(gold)
    return pred_value == gold_value if pred_value is not None and gold_value is not None else None


# ---------------------------------------------------------------------------
# Equivalence with math-verify, in worker processes with a hard time limit per sample
# ---------------------------------------------------------------------------

# math-verify's own timeouts use SIGALRM, which only a main thread can set, and even there cannot
# stop a long computation inside sympy that holds the GIL ("9^{9^{9^9}}", "1000000!", 5,000 nested
# braces). So it runs in worker processes, and a sample that takes longer than TIME_LIMIT_S gets 0
# and its worker is killed and replaced. Ordinary answers take 1-100 ms there; "x^2 + 2x" against
# "x(x+2)" took 0.55 s on a loaded 2-core machine. Reading the answer out of the completion runs
# there too, under the same limit: the rules above are written to be linear, but a regular
# expression that backtracks is easy to add (one took 4.3 s on "1", 2,000 spaces, "x\text{a}"), and
# no text a policy writes may stall the run.
TIME_LIMIT_S = 1.0
GRADER_PROCESSES = min(4, os.cpu_count() or 1)  # per training process

# A bare list "2, 4, 3" is a set unless the question asks for an order ("\boxed{2, 3, 4}" was
# accepted there). So is a list of named values: "Determine the values of $T(10), T(11)$ and
# $T(12)$." (ProcessBench olympiadbench-441: 2, 3, 4 for the reference 2, 4, 3 was accepted). An
# order asked of the answer, not one the problem describes: "the list $3 n^{2}, m^{2}, 2(n+1)^{2}$
# consists of three consecutive integers written in increasing order. Determine all possible values
# of $m$." (olympiadbench-689) is a set.
_ORDERED = re.compile(r"ordered\s+(?:pair|triple|quadruple|tuple|list)|"
                      r"(?<!the )(?<!a )\b(?:list|enter|write|give|express|arrange|put|sort|order"
                      r"|separated)\b[^.?]*"
                      r"\bin\s+(?:increasing|decreasing|ascending|descending|alphabetical|that"
                      r"|this|"
                      r"the\s+same)\s+order|"
                      r"\bin\s+order\b(?!\s+(?:to|for|that)\b)|"
                      r"[a-z]\(-?\d+\)\$?\s*(?:,\s*(?:and\s+)?|and\s+)\$?[a-z]\(-?\d+\)",
                      re.IGNORECASE)


def _split_list(s: str) -> list[str]:
    """The items of a bare comma list, split at commas outside brackets: "1, (2,3)" -> ["1",
    "(2,3)"]."""
    items = []
    depth = 0
    start = 0
    for i, c in enumerate(s):
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            items.append(s[start:i].strip())
            start = i + 1
    return items + [s[start:].strip()]


@functools.lru_cache(maxsize=4096)  # the G completions of a prompt share its reference
def _parse(s: str) -> list:
    """math-verify parse of a bare answer; the ``\\boxed{}`` makes it read the whole string."""
    return parse(f"$\\boxed{{{s}}}$", _EXTRACTION_CONFIG, parsing_timeout=None)


def _verify(pred: str, gold: str, ordered: bool) -> bool:
    """math-verify's verdict, with ordered bare lists compared item by item. Only in a worker: it
    may not return."""
    gold_items = _split_list(gold) if ordered else []
    if ordered and len(gold_items) > 1:
        pred_items = _split_list(pred)
        pairs = [_prepared(p, g) for p, g in zip(pred_items, gold_items)]
        verdicts = (_quick_verdict(*pair) or _verify(*pair, False) for pair in pairs)
        return len(pred_items) == len(gold_items) and all(verdicts)
    try:
        gold_parsed = _parse(gold)
        pred_parsed = _parse(pred)
        return bool(gold_parsed and pred_parsed
                    and verify(gold_parsed, pred_parsed, timeout_seconds=None))
    except Exception:
        return False


def _read_answer(prompt: str, completion: str,
                 answer: str | int | float) -> tuple[str | None, str, bool]:
    """What ``math_accuracy`` compares: the completion's final answer, the reference, and whether
    order matters."""
    return extract_answer(completion), extract_gold(answer), bool(_ORDERED.search(str(prompt)))


# A final answer longer than this (and than twice the reference) is not read: the longest of 3,312
# real solutions' answers is 187 characters (tests/data/grader_realdata.jsonl.gz), and math-verify
# takes seconds on a 1 MB one.
MAX_ANSWER_CHARS = 1000


def _screen(pred: str | None, gold: str, ordered: bool) -> bool | tuple[str, str, bool]:
    """The verdict where no parsing is needed (most GSM8K-style answers), else the job for
    ``_verify``."""
    if pred is None or len(pred) > max(MAX_ANSWER_CHARS, 2 * len(gold)):
        return False
    prepared = _prepared(pred, gold)
    verdict = _quick_verdict(*prepared)
    if verdict is False and _percent_as_fraction(pred, gold, prepared):
        return True
    return (*prepared, ordered) if verdict is None else verdict


_TASKS = {"read": lambda *args: _screen(*_read_answer(*args)), "screen": _screen, "verify": _verify}


def _serve(fd: int) -> None:
    """A worker process: answer ``(index, task, *args)`` with ``(index, result, error)`` until the
    pipe closes."""
    # die with the parent even while stuck inside sympy (PR_SET_PDEATHSIG = 1)
    if sys.platform == "linux":
        import ctypes
        import signal
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    # "timeout is disabled": the parent enforces it
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    conn = Connection(fd)
    # first-call imports and parser set-up, before any sample's clock
    _TASKS["read"]("q", r"so \boxed{1/2}", "0.5")
    _verify("1/2", "0.5", False)
    conn.send("ready")
    while True:
        try:
            index, task, *args = conn.recv()
        except EOFError:
            return
        try:
            conn.send((index, _TASKS[task](*args), None))
        except Exception:  # a bug in the rules above: the parent raises it, with this traceback
            import traceback
            conn.send((index, None, traceback.format_exc()))


class _Worker:
    """A grading process, the pipe to it, and the job it holds with that job's deadline."""

    def __init__(self):
        parent_end, child_end = Pipe()
        # where `import common.tasks.math_grader` works
        root = Path(__file__).resolve().parents[__name__.count(".")]
        code = (f"import sys; sys.path.insert(0, {str(root)!r}); "
                f"from {__name__} import _serve; _serve({child_end.fileno()})")
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[child_end.fileno()],
                                        stdin=subprocess.DEVNULL)
        child_end.close()
        self.conn = parent_end
        self.ready = False
        self.job = None
        self.started = 0.0
        self.deadline = math.inf

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


class _Pool:
    """Worker processes that grade jobs one at a time each; a job past its deadline kills its
    worker."""

    def __init__(self, size: int):
        self.size = size
        self.pid = os.getpid()
        self.workers = []
        self.lock = threading.Lock()

    def run(self, jobs: list[tuple], limits: list[float]) -> tuple[list, list[float]]:
        """Each job's result, None for one that ran over its limit (seconds) or killed its worker,
        and the seconds each took. A job is ``(task, *args)``, a task one of ``_TASKS``."""
        with self.lock:
            # all of them: a spare keeps grading while a killed one restarts
            while len(self.workers) < self.size:
                self.workers.append(_Worker())
            results = [None] * len(jobs)
            seconds = [0.0] * len(jobs)
            errors = []
            pending = deque(range(len(jobs)))
            left = len(jobs)
            while left:
                for w in self.workers:
                    if w.ready and w.job is None and pending:
                        w.job = pending.popleft()
                        w.started = time.monotonic()
                        w.deadline = w.started + limits[w.job]
                        w.conn.send((w.job, *jobs[w.job]))
                soonest = min(w.deadline for w in self.workers)
                for conn in wait([w.conn for w in self.workers], None if soonest == math.inf else
                                 max(soonest - time.monotonic(), 0)):
                    w = next(w for w in self.workers if w.conn is conn)
                    try:
                        message = conn.recv()
                    # the worker died (out of memory, killed from outside)
                    except (EOFError, OSError):
                        if not w.ready:
                            raise RuntimeError(f"a grading worker failed to start (exit code "
                                               f"{w.process.wait()})")
                        left -= w.job is not None
                        self._replace(w)
                        continue
                    if message == "ready":
                        w.ready = True
                    else:
                        index, results[index], error = message
                        seconds[index] = time.monotonic() - w.started
                        errors += [error] if error else []
                        w.job = None
                        w.deadline = math.inf
                        left -= 1
                for w in list(self.workers):
                    if w.job is not None and time.monotonic() > w.deadline:
                        seconds[w.job] = time.monotonic() - w.started
                        left -= 1
                        self._replace(w)
            if errors:  # raised only now, with no worker left holding a job of this call
                raise RuntimeError(f"grading raised in a worker process:\n{errors[0]}")
            return results, seconds

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self.workers[self.workers.index(worker)] = _Worker()

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.workers = []


_POOL: _Pool | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> _Pool:
    """This process's pool, created on first use (and anew in a forked child, which must not share
    pipes)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL.pid != os.getpid():
            _POOL = _Pool(GRADER_PROCESSES)
    return _POOL


@atexit.register
def _close_pool() -> None:
    if _POOL is not None and _POOL.pid == os.getpid():
        _POOL.close()


# Jobs that ran over the time limit once, by hash (a job can hold a 1 MB completion): a policy that
# collapses onto one pathological answer would otherwise cost a time limit and a worker restart per
# completion, every step.
_TIMED_OUT: dict[int, None] = {}


def _run_distinct(jobs: list[tuple], limits: list[float]) -> tuple[list, list[float]]:
    """``_Pool.run`` for jobs that repeat (the G completions of a prompt often give the same
    answer): each distinct job runs once, under the smallest of its limits, and one that timed out
    before does not run again (None)."""
    limit_of: dict[tuple, float] = {}
    for job, limit in zip(jobs, limits):
        limit_of[job] = min(limit_of.get(job, limit), limit)
    todo = [job for job in limit_of if hash(job) not in _TIMED_OUT]
    done = dict(zip(todo, zip(*_pool().run(todo, [limit_of[job] for job in todo])))) if todo else {}
    for job, (result, _) in done.items():
        if result is None:
            _TIMED_OUT[hash(job)] = None
            if len(_TIMED_OUT) > 1024:
                del _TIMED_OUT[next(iter(_TIMED_OUT))]
    results = [done.get(job, (None, 0.0)) for job in jobs]
    return [r for r, _ in results], [t for _, t in results]


def _grade(jobs: list[tuple]) -> tuple[list[bool], list[bool]]:
    """(verdicts, timed out) for ``("read", prompt, completion, answer)`` or ``("screen", pred,
    gold, ordered)`` jobs.

    Text a model wrote is only ever handled in the worker processes, under the time limit, in two
    rounds: the first reads and normalises the answer and settles what needs no parsing
    (``_screen``); the second runs math-verify on the rest, within what is left of each sample's
    ``TIME_LIMIT_S``.
    """
    screened, seconds = _run_distinct(jobs, [TIME_LIMIT_S] * len(jobs))
    results = screened.copy()
    for i, result in enumerate(screened):
        # no time left to verify: a timeout
        if isinstance(result, tuple) and seconds[i] > TIME_LIMIT_S - 0.01:
            results[i] = None
    to_verify = [i for i, result in enumerate(results) if isinstance(result, tuple)]
    verified, _ = _run_distinct([("verify", *screened[i]) for i in to_verify],
                                [TIME_LIMIT_S - seconds[i] for i in to_verify])
    for i, verdict in zip(to_verify, verified):
        results[i] = verdict
    return [bool(r) for r in results], [r is None for r in results]


def is_equivalent(pred: str | None, gold: str, ordered: bool = False) -> bool:
    """Whether a predicted answer means the same as the reference answer. Never raises, and returns
    False after at most about ``TIME_LIMIT_S`` seconds, in any thread (see ``_Pool``)."""
    return _grade([("screen", pred, gold, ordered)])[0][0]


@register_reward("math_accuracy")
def math_accuracy(prompts: list[str], completions: list, answer: list, **_) -> Rewards:
    """1.0 when the completion's final answer is equivalent to the reference answer, else 0.0.

    The reference may be text, an int or a float. ``metrics["timeouts"]`` marks the samples whose
    grading ran over ``TIME_LIMIT_S`` (reward 0; logged as ``reward/math_accuracy/timeouts/mean``).
    A reference of None gets reward 0 and a warning that counts them: raising would stop a run, or
    an evaluation, on one unlabeled row, and its G completions get equal rewards, so no gradient,
    anyway.
    """
    # text, or TRL's conversational form
    prompts = texts_of(prompts)
    completions = texts_of(completions)
    missing = [i for i, a in enumerate(answer) if a is None]
    if missing:
        warnings.warn(f"math_accuracy: {len(missing)} of {len(answer)} samples have no reference "
                      f"answer (None), the first at sample {missing[0]}; they get reward 0",
                      stacklevel=2)
    verdicts, timed_out = _grade(
        [("read", p, c, a) if a is not None else ("screen", None, "", False)
         for p, c, a in zip(prompts, completions, answer)])
    return Rewards([float(v) for v in verdicts], {"timeouts": [float(t) for t in timed_out]})


@register_reward("format")
def format_reward(prompts: list[str], completions: list, **_) -> list[float]:
    """1.0 when the completion closes any ``<think>`` it opened and then gives a ``\\boxed{}``
    answer.

    Rewards finishing the reasoning and committing to a gradable answer, whether or
    not that answer is right.
    """
    rewards = []
    for c in texts_of(completions):  # text, or TRL's conversational form
        if "<think>" in c and "</think>" not in c:
            rewards.append(0.0)
            continue
        answer_part = c.rsplit("</think>", 1)[-1]
        rewards.append(float(_last_boxed(answer_part) is not None))
    return rewards
