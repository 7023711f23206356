"""Writes tests/data/grader_realdata.jsonl.gz: real model solutions with independent correctness labels (issue 15).

    python tests/data/make_grader_realdata.py MIRROR_ROOT     # from the repository root

Each source is read with ``git --git-dir=MIRROR_ROOT/<owner+name>/repo show <commit>:<path>`` from a clone of the
repository (any clone works: pass a folder holding ``<owner>+<name>/repo`` git directories). Rows:
``{set, id, generator, question, completion, answer, label}``; ``label`` is 1.0 when the source judged the
completion's final answer correct. tests/test_grader_realdata.py grades them; tests/data/GRADER_LABEL_ERRORS.md
lists the rows whose label we judged wrong.

Sources
-------
ProcessBench (Qwen, arXiv 2412.06559): QwenLM/ProcessBench @ 2f2fd8ae590aeb949f7be265478b05280f93db68,
    dataset/{math,olympiadbench,omnimath,gsm8k}.json (the data left the GitHub repo at 606615c; Apache-2.0 per the
    Hugging Face card Qwen/ProcessBench). Solutions by 10 open models (Qwen2/2.5(-Math), Llama-3/3.1), split into
    paragraphs by an LLM (solutions whose final answer changed in that step were dropped). Label:
    ``final_answer_correct``, from Qwen2.5-72B-Instruct judging the final answer against the reference; every
    solution was also annotated by three or more experts, and those judged wrong whose process the experts found
    correct were discarded. The files hold no reference answer: it is joined by whitespace-normalised problem text
    from
      MATH test      ZubinGou/math-evaluation-harness @ db77bc6bb2a17c90ed2d63e88ebd8c40a82858c5, data/math/test.jsonl
                     (MIT): the last \\boxed{} of the solution. Joins 1000 of 1000.
      GSM8K test     same repo and commit, data/gsm8k/test.jsonl (MIT): the text after "####". Joins 400 of 400.
      OlympiadBench  QwenLM/Qwen2.5-Math @ a45202bd16f1ec06f433442dc1152d0074773465,
                     evaluation/data/olympiadbench/test.jsonl (evaluation/LICENSE: MIT): final_answer (a list, joined
                     with ", "). Joins 986 of 1000.
      Omni-MATH      KbsdJames/omni-math-rule @ 4793415ef37d31c9cdb4e5b82dbe172f76f8cf08, omni_math_rule.jsonl (the
                     rule-gradable subset; Omni-MATH is Apache-2.0 per its card). Joins 649 of 1000.
ReasonEval MR-MATH: GAIR-NLP/ReasonEval @ 6c91c7a16e2b0e12ebc89685207cd091fb411478 (no licence file),
    dataset/mr-math_invalid_errors.json: 159 solutions by Abel / WizardMath, final answers all labelled correct by
    human annotators (set "reasoneval/mr-math_invalid"); dataset/mr-math_redundant_errors.json: PRM800K (MIT) GPT-4
    solutions; the 118 that end in a "# Answer" step are kept, label = PRM800K's human rating of that step > 0
    (set "reasoneval/prm800k").
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
OUT = Path(__file__).parent / "grader_realdata.jsonl.gz"
PROCESSBENCH = ("QwenLM/ProcessBench", "2f2fd8ae590aeb949f7be265478b05280f93db68")
HARNESS = ("ZubinGou/math-evaluation-harness", "db77bc6bb2a17c90ed2d63e88ebd8c40a82858c5")
QWEN_MATH = ("QwenLM/Qwen2.5-Math", "a45202bd16f1ec06f433442dc1152d0074773465")
OMNI_RULE = ("KbsdJames/omni-math-rule", "4793415ef37d31c9cdb4e5b82dbe172f76f8cf08")
REASONEVAL = ("GAIR-NLP/ReasonEval", "6c91c7a16e2b0e12ebc89685207cd091fb411478")


def show(source: tuple[str, str], path: str) -> str:
    repo, commit = source
    git_dir = MIRRORS / repo.replace("/", "+") / "repo"
    return subprocess.run(["git", f"--git-dir={git_dir}", "show", f"{commit}:{path}"], check=True,
                          capture_output=True).stdout.decode("utf-8")


def jsonl(source, path):
    return [json.loads(line) for line in show(source, path).splitlines() if line.strip()]


def norm(text: str) -> str:
    return " ".join(text.split())


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} of a MATH reference solution."""
    i = text.rfind("\\boxed")
    j = text.find("{", i)
    if i < 0 or j < 0:
        return None
    depth = 0
    for k in range(j, len(text)):
        depth += (text[k] == "{") - (text[k] == "}")
        if depth == 0:
            return text[j + 1 : k]
    return None


def references(split: str) -> dict[str, str]:
    if split == "math":
        return {norm(r["problem"]): last_boxed(r["solution"]) for r in jsonl(HARNESS, "data/math/test.jsonl")}
    if split == "gsm8k":
        return {norm(r["question"]): r["answer"].rsplit("####", 1)[1].strip()
                for r in jsonl(HARNESS, "data/gsm8k/test.jsonl")}
    if split == "olympiadbench":
        return {norm(r["question"]): ", ".join(r["final_answer"])
                for r in jsonl(QWEN_MATH, "evaluation/data/olympiadbench/test.jsonl")}
    if split == "omnimath":
        return {norm(r["problem"]): r["answer"] for r in jsonl(OMNI_RULE, "omni_math_rule.jsonl")}
    raise ValueError(split)


def processbench(split: str) -> list[dict]:
    refs = references(split)
    rows = []
    for x in json.loads(show(PROCESSBENCH, f"dataset/{split}.json")):
        answer = refs.get(norm(x["problem"]))
        if answer is None:  # no reference for this problem (olympiadbench: 14 of 1000, omnimath: 351 of 1000)
            continue
        rows.append({"set": f"processbench/{split}", "id": x["id"], "generator": x["generator"],
                     "question": x["problem"], "completion": "\n\n".join(x["steps"]), "answer": answer,
                     "label": float(x["final_answer_correct"])})
    return rows


def reasoneval() -> list[dict]:
    rows = []
    for r in jsonl(REASONEVAL, "dataset/mr-math_invalid_errors.json"):
        rows.append({"set": "reasoneval/mr-math_invalid", "id": f"mr-math_invalid-{r['id']}",
                     "generator": r["generator"], "question": r["question"], "completion": r["model_output"],
                     "answer": r["ground_truth_answer"],
                     "label": float(r["model_output_answer_correctness"] == "correct")})
    for r in jsonl(REASONEVAL, "dataset/mr-math_redundant_errors.json"):
        steps = [s[0] for s in r["model_output_step_format"]]
        if not steps or not steps[-1].startswith("# Answer"):
            continue  # cut off before the answer step: no final answer to grade
        rows.append({"set": "reasoneval/prm800k", "id": f"prm800k-{r['id']}", "generator": r["generator"],
                     "question": r["question"], "completion": "\n".join(steps), "answer": r["ground_truth_answer"],
                     "label": float(r["rating"][-1] > 0)})
    return rows


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        sys.exit(USAGE)
    MIRRORS = Path(sys.argv[1])
    rows = [row for split in ("math", "olympiadbench", "omnimath", "gsm8k") for row in processbench(split)]
    rows += reasoneval()
    assert len({r["id"] for r in rows}) == len(rows), "ids must be unique"
    with gzip.open(OUT, "wt", encoding="utf-8", compresslevel=9) as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(len(rows), "rows ->", OUT, OUT.stat().st_size, "bytes")
