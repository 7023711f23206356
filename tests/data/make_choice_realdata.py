"""Writes tests/data/choice_realdata.jsonl.gz: real multiple-choice model outputs with gold letters (issue 31).

    python tests/data/make_choice_realdata.py MIRROR_ROOT     # from the repository root

The source is read with ``git --git-dir=MIRROR_ROOT/<owner+name>/repo show <commit>:<path>`` from a clone of the
repository (any clone works: pass a folder holding ``<owner>+<name>/repo`` git directories). Rows:
``{set, id, generator, question, completion, answer, label, pred}``; ``question`` is the question with its options as
the model's prompt listed them (MMLU-Pro's ``format_example``: "Question: ...\\nOptions: A. ...\\nB. ...\\nAnswer: Let
think step by step."; the prompt also held five solved examples of the same subject, left out here), ``answer`` the
gold letter, ``pred`` MMLU-Pro's own extraction of the chosen letter (None where its regex found none), and ``label``
1.0 when ``pred`` is the gold letter. ``pred`` is a regex (``answer is \\(?([A-J])\\)?``, first match), not a judge:
every row where ``common.tasks.choice_grader.extract_choice`` reads another letter than ``pred`` was read by hand, and the
verdict, with the letter the completion chose, is in tests/data/CHOICE_DISAGREEMENTS.md; tests/test_grader_realdata.py
grades the rows with ``choice_accuracy`` against the label corrected by that table.

Source
------
MMLU-Pro (TIGER-AI-Lab, arXiv 2406.01574): TIGER-AI-Lab/MMLU-Pro @ eeeb46ca13acc9e60ce45a8dc2fb141ee76600ab,
    eval_results/gpt4o/<subject>_result.json (set "mmlu-pro/gpt4o": gpt-4o, May 2024, temperature 0.1, by
    run_gpt4o.py at that commit) and eval_results/deepseek/<subject>_result.json (set "mmlu-pro/deepseek":
    deepseek-chat, DeepSeek-V2, by run_deepseek.py), for the 14 subjects biology, business, chemistry, computer
    science, economics, engineering, health, history, law, math, other, philosophy, physics, psychology; the first
    ROWS_PER_SUBJECT records of each file (280 per model). The files left the repository at 8f97a48 (zipped since).
    Licence: the repository's LICENSE is Apache-2.0; the data set's card (Hugging Face TIGER-Lab/MMLU-Pro) says MIT.
"""
import gzip
import json
import subprocess
import sys
from pathlib import Path

MIRRORS: Path  # MIRROR_ROOT, the command's one argument
USAGE = f"""usage: python tests/data/{Path(__file__).name} MIRROR_ROOT

MIRROR_ROOT: a folder holding one <owner>+<name>/repo git directory (a clone) per source repository named in this
script's docstring; the data are read from those clones at the pinned commits."""
OUT = Path(__file__).parent / "choice_realdata.jsonl.gz"
MMLU_PRO = ("TIGER-AI-Lab/MMLU-Pro", "eeeb46ca13acc9e60ce45a8dc2fb141ee76600ab")
SOURCES = {"gpt4o": "gpt-4o", "deepseek": "deepseek-chat"}
SUBJECTS = ["biology", "business", "chemistry", "computer science", "economics", "engineering", "health", "history",
            "law", "math", "other", "philosophy", "physics", "psychology"]
ROWS_PER_SUBJECT = 20
LETTERS = "ABCDEFGHIJ"


def show(source: tuple[str, str], path: str) -> str:
    repo, commit = source
    git_dir = MIRRORS / repo.replace("/", "+") / "repo"
    return subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{commit}:{path}"], check=True,
                          capture_output=True).stdout.decode("utf-8")


def format_example(question: str, options: list[str]) -> str:
    """MMLU-Pro's prompt for the question asked (run_gpt4o.py / run_deepseek.py ``format_example``, ``.strip()``)."""
    example = "Question: {}\nOptions: ".format(question)
    for i, opt in enumerate(options):
        example += "{}. {}\n".format(LETTERS[i], opt)
    return (example + "Answer: Let think step by step.\n\n").strip()


def rows_of(name: str) -> list[dict]:
    rows = []
    for subject in SUBJECTS:
        for r in json.loads(show(MMLU_PRO, f"eval_results/{name}/{subject}_result.json"))[:ROWS_PER_SUBJECT]:
            options = [o for o in r["options"] if o != "N/A"]  # as preprocess() drops them before the prompt
            rows.append({"set": f"mmlu-pro/{name}", "id": f"{name}-{r['question_id']}", "generator": SOURCES[name],
                         "question": format_example(r["question"], options), "completion": r["response"],
                         "answer": r["answer"], "label": float(r["pred"] == r["answer"]), "pred": r["pred"]})
    return rows


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        sys.exit(USAGE)
    MIRRORS = Path(sys.argv[1])
    rows = [row for name in SOURCES for row in rows_of(name)]
    assert len({r["id"] for r in rows}) == len(rows), "ids must be unique"
    with gzip.open(OUT, "wt", encoding="utf-8", compresslevel=9) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(len(rows), "rows ->", OUT, OUT.stat().st_size, "bytes")
