"""Agreement of math_accuracy with independent correctness labels, on public GSM8K files you have locally.

    python benchmarks/grader_agreement.py --gsm8k DIR [--out disagreements.jsonl]

DIR holds the files of OpenAI's grade-school-math repository (grade_school_math/data/):
- example_model_solutions.jsonl: 1,319 test problems, each solved by four GPT-3 models ("6b_finetuning", ...),
  each solution labelled "is_correct" by the dataset's authors. Reported: how often math_accuracy agrees.
- train.jsonl, test.jsonl: the reference solutions. Reported: how often the solution text before "####",
  which ends in no marked answer, is graded correct against its own "#### answer" (the trailing-expression rule).
Nothing is downloaded and nothing of these files is kept in the repository. Every disagreement is written to
--out for reading (reading them is how the rules in common/tasks/rewards.py were checked).
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.tasks.math_grader import extract_answer, extract_gold, math_accuracy  # noqa: E402

MODELS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def model_solutions(folder: str) -> list[dict]:
    """One row per labelled solution: question, solution, reference answer, label."""
    rows = []
    for problem in read_jsonl(os.path.join(folder, "example_model_solutions.jsonl")):
        gold = problem["ground_truth"].rsplit("A:", 1)[1].strip()  # this file ends its references in "A: 18"
        for model in MODELS:
            rows.append({"set": f"model_solutions/{model}", "question": problem["question"], "answer": gold,
                         "completion": problem[model]["solution"], "label": float(problem[model]["is_correct"])})
    return rows


def reference_solutions(folder: str, split: str) -> list[dict]:
    """One row per problem: the solution without its "#### answer" line, which must grade as correct."""
    rows = []
    for problem in read_jsonl(os.path.join(folder, f"{split}.jsonl")):
        solution, answer = problem["answer"].rsplit("####", 1)
        rows.append({"set": f"references/{split}", "question": problem["question"], "answer": answer.strip(),
                     "completion": solution, "label": 1.0})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gsm8k", required=True,
                        help="folder with example_model_solutions.jsonl, train.jsonl, test.jsonl")
    parser.add_argument("--out", default="grader_disagreements.jsonl", help="where to write every disagreement")
    args = parser.parse_args()
    rows = model_solutions(args.gsm8k)
    rows += reference_solutions(args.gsm8k, "train") + reference_solutions(args.gsm8k, "test")
    start = time.time()
    rewards = math_accuracy([r["question"] for r in rows], [r["completion"] for r in rows],
                            answer=[r["answer"] for r in rows])
    seconds = time.time() - start
    with open(args.out, "w") as out:
        for name in dict.fromkeys(r["set"] for r in rows):
            picked = [(r, v) for r, v in zip(rows, rewards) if r["set"] == name]
            agree = sum(v == r["label"] for r, v in picked)
            print(f"{name}: {agree}/{len(picked)} = {100 * agree / len(picked):.2f}% agree with the labels")
            for r, v in picked:
                if v != r["label"]:
                    out.write(json.dumps({**r, "graded": v, "extracted": extract_answer(r["completion"]),
                                          "gold": extract_gold(r["answer"])}) + "\n")
    print(f"{len(rows)} completions graded in {seconds:.1f} s; timeouts: {int(sum(rewards.metrics['timeouts']))}; "
          f"disagreements in {args.out}")


if __name__ == "__main__":
    main()
