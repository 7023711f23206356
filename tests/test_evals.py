"""evals/: benchmark schemas (fixtures in the hub schema), the shared grader, pass@k, error messages,
model loading (checkpoints, LoRA adapters), and an end-to-end evaluation of the toy model."""

import itertools
import json
import os
import shutil
import subprocess
import sys

import datasets
import pytest
import torch
from huggingface_hub.errors import GatedRepoError

from common.tasks import math_grader
from common.tasks.benchmark_scoring import (
    _stats,
    evaluate_benchmarks,
    k_values,
    load_eval_sets,
    pass_at_k,
    run_eval_set,
)
from common.tasks.benchmark_sets import BENCHMARKS, get_benchmark, get_grader, load_benchmark
from common.tasks.choice_grader import choice_accuracy, extract_choice
from common.tasks.math_grader import is_equivalent, math_accuracy
from common.tasks.reward_names import get_reward_function
from common.tasks.toy import TOY_DIR, toy_addition
from evals.run import EvalArgs, load_model, main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "evals", "fixtures")


@pytest.fixture(autouse=True)
def patient_grader(monkeypatch):
    """These tests are about what is graded right, not how fast: the grader's 1 s limit per sample (held by
    tests/test_rewards.py) graded "x^{2} + 2 x" 0 on a 2-core machine loaded by CI's two streams."""
    monkeypatch.setattr(math_grader, "TIME_LIMIT_S", 30.0)

# The columns of each hub dataset and their types (None is allowed too), as the "schema:" comments of
# common/tasks/benchmark_sets.py record where they were checked (GPQA: only the columns we read and a few more; the real
# file also has Pre-Revision* and validator columns). The fixtures must match exactly.
MATH_ARENA = {"problem_idx": int, "problem": str, "answer": str, "problem_type": list}
HUB_SCHEMA = {
    "gsm8k": {"question": str, "answer": str},
    "math500": {"problem": str, "solution": str, "answer": str, "subject": str, "level": int, "unique_id": str},
    "math": {"problem": str, "level": str, "solution": str, "type": str},
    "aime24": {"id": int, "problem": str, "solution": str, "answer": str, "url": str, "year": str},
    "aime25": MATH_ARENA | {"answer": int},
    "aime26": {"problem_idx": int, "answer": int, "problem": str},
    "amc23": {"id": int, "question": str, "answer": float, "url": str},
    "hmmt_feb25": MATH_ARENA,
    "hmmt_nov25": MATH_ARENA,
    "brumo25": MATH_ARENA,
    "gpqa_diamond": {c: str for c in ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2",
                                      "Incorrect Answer 3", "Explanation", "Subdomain", "High-level domain",
                                      "Record ID")},
    "mmlu_pro": {"question_id": int, "question": str, "options": list, "answer": str, "answer_index": int,
                 "cot_content": str, "category": str, "src": str},
    "mmlu_redux": {"question": str, "choices": list, "answer": int, "error_type": str, "source": str,
                   "correct_answer": str, "potential_reason": str},
}


def fixture(name: str) -> str:
    return os.path.join(FIXTURES, f"{name}.jsonl")


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


# --- benchmarks and fixtures ------------------------------------------------------


def test_every_benchmark_has_a_fixture():
    assert set(HUB_SCHEMA) == set(BENCHMARKS) - {"toy"}
    assert {f[: -len(".jsonl")] for f in os.listdir(FIXTURES)} == set(HUB_SCHEMA)


@pytest.mark.parametrize("name", sorted(HUB_SCHEMA))
def test_fixture_has_the_hub_schema_and_loads(name):
    rows, schema = read_jsonl(fixture(name)), HUB_SCHEMA[name]
    assert all(set(row) == set(schema) for row in rows)
    assert all(row[c] is None or isinstance(row[c], t) for row in rows for c, t in schema.items())
    benchmark = get_benchmark(name)
    assert {benchmark.prompt_column, benchmark.answer_column} <= set(schema)
    examples = load_benchmark(name, fixture(name))
    assert examples and all(isinstance(e["prompt"], str) and isinstance(e["answer"], str) for e in examples)
    # the reference answer, boxed, gets full marks from the benchmark's own grader
    gold = [e["answer"] if benchmark.grader == "choice" else e["answer"].rsplit("####", 1)[-1] for e in examples]
    completions = [f"So the answer is $\\boxed{{{g.strip()}}}$." for g in gold]
    if name == "math":  # the answer column is a whole solution: it is its own (boxed) completion
        completions = [e["answer"] for e in examples]
    assert get_grader(benchmark)([e["prompt"] for e in examples], completions,
                                 answer=[e["answer"] for e in examples]) == [1.0] * len(examples)


def test_data_dir_and_groups():
    examples = load_benchmark("math500", data_dir=FIXTURES)
    assert [e["groups"] for e in examples][:2] == [{"level": ["1"], "subject": ["Prealgebra"]},
                                                   {"level": ["3"], "subject": ["Algebra"]}]
    hmmt = load_benchmark("hmmt_feb25", data_dir=FIXTURES)
    assert hmmt[2]["groups"] == {"problem_type": ["Combinatorics", "Algebra"]}  # a problem in two groups


def test_multiple_choice_prompts():
    pro = load_benchmark("mmlu_pro", fixture("mmlu_pro"))
    assert pro[0]["prompt"].splitlines()[2:5] == ["A. 21", "B. 27", "C. 29"] and pro[0]["answer"] == "C"
    assert pro[1]["prompt"].endswith("D. newton") and pro[1]["answer"] == "D"
    redux = load_benchmark("mmlu_redux", fixture("mmlu_redux"))
    assert len(redux) == 2  # the row annotated "wrong_groundtruth" is not scored
    assert [e["answer"] for e in redux] == ["B", "C"]


def test_gpqa_options_shuffled_deterministically():
    first = load_benchmark("gpqa_diamond", fixture("gpqa_diamond"))
    again = load_benchmark("gpqa_diamond", fixture("gpqa_diamond"))
    assert first == again
    for row, example in zip(read_jsonl(fixture("gpqa_diamond")), first):
        options = dict(line.split(". ", 1) for line in example["prompt"].splitlines()[2:])
        assert options[example["answer"]] == row["Correct Answer"]
        assert set(options.values()) == {row["Correct Answer"]} | {row[f"Incorrect Answer {i}"] for i in (1, 2, 3)}
    assert len({e["answer"] for e in first}) > 1  # the correct answer is not always first


def test_multi_config_benchmark_from_the_hub(monkeypatch):
    """MMLU-Redux is one hub config per subject: loaded one by one, concatenated, grouped by config."""
    calls = []

    def fake_load_dataset(path, name=None, split=None, **_):
        calls.append((path, name, split))
        return datasets.Dataset.from_list(read_jsonl(fixture("mmlu_redux")))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    examples = load_benchmark("mmlu_redux")
    assert len(calls) == 57 and calls[0] == ("edinburgh-dawg/mmlu-redux-2.0", "abstract_algebra", "test")
    assert len(examples) == 57 * 2 and examples[0]["groups"] == {"config": ["abstract_algebra"]}


# --- one grader for training and evaluation ---------------------------------------------


def test_graders_are_the_training_rewards():
    assert get_grader(get_benchmark("math500")) is math_accuracy is get_reward_function("math_accuracy")
    assert get_grader(get_benchmark("gpqa_diamond")) is choice_accuracy is get_reward_function("choice_accuracy")
    assert get_grader(get_benchmark("toy")) is toy_addition


# Each pair checked with math-verify 0.9; numbers written as words ("twenty" vs 20) are in tests/test_rewards.py.
# Not supported, so not asserted: degrees vs radians (90^\circ vs \pi/2).
@pytest.mark.parametrize("pred, gold", [
    (r"\dfrac{3}{4}", r"\frac34"), (r"\tfrac{3}{4}", "0.75"), (r"\frac{6}{8}", r"\frac{3}{4}"), ("2.5", r"\frac{5}{2}"),
    (r"x^{2} + 2 x", "x^2+2x"), (r"2 \sqrt {3}", r"2\sqrt3"), (r"\frac{\sqrt{3}}{3}", r"\frac{1}{\sqrt{3}}"),
    (r"5 \mbox{ inches}", "5"), (r"12 \text{ dollars}", "12"), (r"\$12", "12"), (r"30^{\circ}", "30"),
    ("45", r"45^\circ"),
    (r"20 \text{ degrees}", "20"), (r"\frac{1}{2}\text{ hours}", "0.5"),
    (r"\left[ 1, 3 \right)", "[1,3)"), (r"(-\infty, 2]", r"(-\infty,2]"),
    (r"(-\infty, 0) \cup (1, \infty)", r"(-\infty,0)\cup(1,\infty)"),
    (r"\left(1, -2\right)", "(1,-2)"), ("(1, 2)", "(1,2)"), (r"\{1,2\}", r"\{2,1\}"),
    ("1,000,000", "1000000"), ("1{,}000", "1000"), (r"\$1,000", "1000"), ("1,000.50", "1000.5"),
    (r"\text{even}", "even"), ("(C)", r"\text{(C)}"), ("y = \\frac{1}{2}", "0.5"), ("27", "27.0"), ("47", "047"),
])
def test_equivalent_answers(pred, gold):
    assert is_equivalent(pred, gold)


@pytest.mark.parametrize("pred, gold", [
    (r"\frac{2}{3}", r"\frac{3}{2}"), (r"\frac{1}{3}", "0.333"), ("-0.5", r"\frac{1}{2}"), ("[1,3)", "(1,3)"),
    (r"(-\infty,2)", r"(-\infty,2]"), ("(1,2)", "[1,2]"), ("(2,1)", "(1,2)"), ("(1,2,3)", "(3,2,1)"), ("1,001", "1000"),
    (r"5 \text{ meters}", "6"), ("odd", r"\text{even}"), (r"\text{Monday}", r"\text{Tuesday}"), ("x^2", "x^3"),
])
def test_not_equivalent_answers(pred, gold):
    assert not is_equivalent(pred, gold)


def test_math_accuracy_on_whole_completions():
    completions = [r"So $\boxed{\boxed{\dfrac{3}{4}}}$", r"\boxed{\frac{\sqrt{2}}{2}}",
                   r"first \boxed{1} then \boxed{(2, \frac{1}{2})}", r"\boxed{\left[ \frac{1}{2}, 3 \right)}",
                   r"<think>\boxed{7}</think> the answer is \boxed{8}"]
    answers = [r"\frac34", r"... \boxed{\frac{1}{\sqrt{2}}}", r"\left(2,\tfrac12\right)", "[0.5,3)", "7"]
    assert math_accuracy([""] * 5, completions, answer=answers) == [1.0, 1.0, 1.0, 1.0, 0.0]


@pytest.mark.parametrize("text, letter", [
    ("The answer is (C).", "C"), (r"so \boxed{C}", "C"), (r"\boxed{\text{(B)}}", "B"), (r"\boxed{B. 42}", "B"),
    ("Answer: D", "D"), ("ANSWER: **B**", "B"), ("The answer is: C", "C"), ("Final answer: C) 12", "C"),
    ("Between (A) and (B), I pick (B) because", "B"), ("I think A is wrong, so it is B.", "B"),
    ("<think>maybe A.</think> The answer is D", "D"), ("C", "C"),
    ("I think so.", None), ("A car goes fast", None), (r"\boxed{12}", None), ("answer is Bob", None),
    (r"\boxed{}", None), (r"\boxed{()}", None), ("", None),
])
def test_extract_choice(text, letter):
    assert extract_choice(text) == letter


def test_choice_accuracy_uses_the_prompts_options():
    prompt = "Q?\n\nA. x\nB. y\nC. z\nD. w"
    completions = ["The answer is E.", "The answer is (B)", "the answer is J", r"\boxed{D}"]
    assert choice_accuracy([prompt] * 4, completions, answer=["E", "B", "J", "(D)"]) == [0.0, 1.0, 0.0, 1.0]
    assert choice_accuracy(["no options listed"], ["the answer is J"], answer=["J"]) == [1.0]
    assert choice_accuracy([prompt] * 2, ["Answer: C", "Answer: C"], answer=[2, 1]) == [1.0, 0.0]  # MMLU's index


# --- metrics -------------------------------------------------------------------------------


@pytest.mark.parametrize("n", range(1, 7))
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        samples = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets), abs=1e-12)


def test_pass_at_k_large_n_and_bad_input():
    assert pass_at_k(1000, 1, 1) == pytest.approx(1e-3)
    assert pass_at_k(1000, 500, 500) == pytest.approx(1.0)
    assert 0.0 < pass_at_k(10_000, 3, 20) < 1.0
    assert k_values(32) == [1, 2, 4, 8, 16, 32] and k_values(6) == [1, 2, 4, 6] and k_values(1) == [1]
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_avg_at_k_is_the_mean_of_sample_scores():
    scores = [[1.0, 0.0, 0.0, 1.0], [0.0] * 4, [1.0] * 4]
    stats = _stats(scores, 4)
    assert stats["avg@4"] == pytest.approx(6 / 12) and stats["pass@1"] == pytest.approx(6 / 12)
    assert stats["pass@4"] == pytest.approx(2 / 3) and stats["num_questions"] == 3


# --- bad input -----------------------------------------------------------------------------


def test_unknown_benchmark_lists_the_known_ones():
    with pytest.raises(ValueError) as info:
        load_benchmark("aime2099")
    assert "aime2099" in str(info.value) and all(name in str(info.value) for name in BENCHMARKS)
    with pytest.raises(SystemExit) as info:
        main(EvalArgs(model="unused", benchmarks="math500,aime2099"))
    assert "known benchmarks" in str(info.value) and "gpqa_diamond" in str(info.value)


def _gated_error() -> GatedRepoError:
    error = GatedRepoError.__new__(GatedRepoError)  # its constructor wants an HTTP response
    Exception.__init__(error, "403 Client Error. Access to dataset Idavidrein/gpqa is restricted.")
    return error


@pytest.mark.parametrize("error", [_gated_error(), FileNotFoundError("Dataset 'x' is a gated dataset on the Hub.")])
def test_gated_dataset_says_how_to_get_access(monkeypatch, error):
    def fake_load_dataset(*args, **kwargs):
        raise error

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(ValueError) as info:
        load_benchmark("gpqa_diamond")
    message = str(info.value)
    assert "accept the terms at https://huggingface.co/datasets/Idavidrein/gpqa" in message
    assert "hf auth login" in message and "HF_TOKEN" in message


def test_hub_failure_suggests_a_local_copy(monkeypatch):
    def fake_load_dataset(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    with pytest.raises(ValueError, match="ConnectionError: no network") as info:
        load_benchmark("aime25")
    assert "--data_dir" in str(info.value) and "aime25=FILE" in str(info.value)
    assert "gated" not in str(info.value)


def test_model_that_does_not_load(tmp_path):
    with pytest.raises(ValueError) as info:
        load_model(str(tmp_path))  # a folder without a model in it
    assert f"cannot load --model {str(tmp_path)!r}" in str(info.value) and "LoRA adapter" in str(info.value)
    with pytest.raises(SystemExit, match="cannot load --model"):
        main(EvalArgs(model=str(tmp_path / "missing"), benchmarks="toy", engine="hf"))


# --- models: checkpoints and adapters ------------------------------------------------------


@pytest.fixture(scope="module")
def toy_model_dir(toy_workdir):
    return str(toy_workdir / TOY_DIR / "model")


def test_training_checkpoint_and_run_folder_load(tmp_path, toy_model_dir):
    run = tmp_path / "run"
    for step in (2, 4):
        shutil.copytree(toy_model_dir, run / "checkpoints" / f"step_{step}" / "model")
        os.makedirs(run / "checkpoints" / f"step_{step}" / "state")
    reference = load_model(toy_model_dir)[0]
    for path in (run / "checkpoints" / "step_2", run):  # a checkpoint, and a run folder (its latest)
        model, tokenizer, weights = load_model(str(path))
        assert weights.endswith(os.path.join("step_4" if path == run else "step_2", "model"))
        assert torch.equal(model.lm_head.weight, reference.lm_head.weight)
        assert tokenizer.padding_side == "left"


def test_lora_adapter_is_merged(tmp_path, toy_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(toy_model_dir),
                                LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    model, tokenizer, weights = load_model(str(tmp_path / "adapter"))
    assert weights == toy_model_dir and not hasattr(model, "peft_config")
    ids = torch.tensor([tokenizer("12+34=")["input_ids"]])
    with torch.no_grad():
        merged = model(ids).logits
        assert torch.allclose(merged, peft_model(ids).logits, atol=1e-5)
        with peft_model.disable_adapter():
            assert not torch.allclose(merged, peft_model(ids).logits, atol=1e-3)  # the adapter does change it


# --- running: reproducible per request, sliced over processes --------------------------------


@pytest.fixture
def one_thread():
    """The toy model is tiny: on a shared CPU, waiting for a second OpenMP thread costs more than it computes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class CountingEngine:
    """Answers every prompt with the tokens of "7" and counts its calls."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def generate(self, model, prompt_ids, seeds, *, max_tokens, temperature, top_p):
        self.calls += 1
        ids = self.tokenizer("7", add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return [ids] * len(prompt_ids), [[0.0] * len(ids)] * len(prompt_ids)

    def wake_up(self):
        pass

    def sleep(self):
        pass


def test_processes_make_the_same_number_of_engine_calls(toy_model_dir, in_toy_workdir):
    _, tokenizer, _ = load_model(toy_model_dir, load_weights=False)
    (eval_set,) = load_eval_sets("toy", tokenizer, max_questions=5)
    engines = [CountingEngine(tokenizer) for _ in range(2)]
    records = [run_eval_set(engines[p], None, tokenizer, eval_set, n=1, temperature=1.0, max_tokens=3, batch_size=2,
                            process_index=p, num_processes=2) for p in range(2)]
    assert [e.calls for e in engines] == [2, 2]  # 3 and 2 questions: the shorter slice is padded
    assert sorted(r["index"] for rs in records for r in rs) == [0, 1, 2, 3, 4]


def test_results_do_not_depend_on_processes_or_batching(toy_model_dir, in_toy_workdir, one_thread):
    from accelerate import Accelerator

    from common.engines.rollout import HFEngine

    model, tokenizer, _ = load_model(toy_model_dir)
    eval_sets = load_eval_sets("toy", tokenizer, max_questions=12)
    engine = HFEngine(tokenizer, Accelerator(cpu=True))
    kwargs = dict(n=3, temperature=1.0, max_tokens=4, seed=5)
    one = evaluate_benchmarks(engine, model, tokenizer, eval_sets, **kwargs)
    slices = {p: run_eval_set(engine, model, tokenizer, eval_sets[0], batch_size=5, process_index=p, num_processes=3,
                              **kwargs) for p in range(3)}
    three = evaluate_benchmarks(engine, model, tokenizer, eval_sets, **kwargs, process_index=0, num_processes=3,
                                gather=lambda records: records + slices[1] + slices[2])
    assert set(one) == {"eval/toy/avg@3", "eval/toy/pass@3"}
    assert one == three and 0.0 < one["eval/toy/avg@3"] < one["eval/toy/pass@3"] < 1.0
    assert evaluate_benchmarks(engine, model, tokenizer, [], **kwargs) == {}


# --- end to end ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_evaluate_toy_model_from_the_command_line(toy_workdir, tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "evals.run", "--model", os.path.join(TOY_DIR, "model"), "--benchmarks", "toy",
               "--n", "2", "--temperature", "1.0", "--max_tokens", "6", "--engine", "hf", "--max_questions", "100",
               "--output", str(out)]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=toy_workdir, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out / "results.json") as f:
        results = json.load(f)
    toy = results["benchmarks"]["toy"]
    scores = [s for q in toy["questions"] for s in q["scores"]]
    assert toy["num_questions"] == 100 == len(toy["questions"]) and len(scores) == 200
    assert set(scores) <= {0.0, 1.0}
    assert 0.0 <= toy["avg@2"] <= 1.0 and toy["avg@2"] == pytest.approx(sum(scores) / len(scores))
    assert toy["pass@2"] == pytest.approx(sum(max(q["scores"]) for q in toy["questions"]) / 100)
    assert results["metrics"] == {"eval/toy/avg@2": toy["avg@2"], "eval/toy/pass@2": toy["pass@2"]}
    samples = read_jsonl(out / "samples" / "toy.jsonl")
    assert len(samples) == 100 and samples[0]["prompt"] == read_jsonl(toy_workdir / TOY_DIR / "test.jsonl")[0]["prompt"]
    assert [s["scores"] for s in samples] == [q["scores"] for q in toy["questions"]]
    assert "| toy | 100 |" in (out / "results.md").read_text()


def test_a_compare_study_resumes_where_it_stopped(in_toy_workdir, tmp_path):
    """evals.compare --resume: a finished run (its result file written) is read, not run again; an interrupted one
    (a checkpoint, no result file) goes on from its checkpoint; a finished run's checkpoints are deleted, its
    metrics.jsonl kept."""
    from evals import compare

    def study(total_steps: int, **flags):
        extra = (f"--total_steps {total_steps} --eval_steps 1 --eval_num_prompts 8 --save_steps 1 --batch_size 16 "
                 "--micro_batch_size 16 --logprob_batch_size 16")
        return compare.main(compare.CompareArgs(algos="grpo", seeds=1, jobs=1, tag="resume", extra=extra, **flags))

    run = os.path.join("runs", "compare-resume", "grpo__s1")
    study(1, keep_checkpoints=True)
    assert os.path.isdir(os.path.join(run, "checkpoints", "step_1"))
    os.remove(run + ".result.json")  # as if the study had been stopped before the run's end was recorded
    with pytest.raises(SystemExit, match="holds a run already; pass another --tag, --resume to go on with it"):
        study(2)
    study(2, resume=True)  # step 2 from the checkpoint of step 1
    with open(os.path.join(run, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == [0, 1, 2], steps  # the evaluation before training, step 1 as it was, step 2 resumed
    assert not os.path.exists(os.path.join(run, "checkpoints")) and os.path.exists(run + ".result.json")
    stamp = os.stat(os.path.join(run, "metrics.jsonl")).st_mtime_ns
    with open(run + ".result.json") as f:
        result = json.load(f)
    assert len(result["minutes"]) == 3 and result["minutes"][0] == 0 and "policy/ess" in result["diagnostics"]
    assert [step for step, _ in result["series"]["policy/ess"]] == [1, 2]
    with open(run + ".result.json", "w") as f:  # as an older version wrote it: evaluations only
        json.dump({k: v for k, v in result.items() if k not in ("minutes", "diagnostics", "series")}, f)
    study(2, resume=True)  # finished: read, not run again (and its record completed from its metrics.jsonl)
    with open(run + ".result.json") as f:
        assert json.load(f) == result
    assert os.stat(os.path.join(run, "metrics.jsonl")).st_mtime_ns == stamp
    with open(os.path.join("runs", "compare-resume", "study.json")) as f:
        written = json.load(f)  # the source of the study's table in the docs (docs/make_diffs.py)
    with open(run + ".result.json") as f:
        assert written["results"] == [json.load(f)]
    assert written["command"].startswith("python -m evals.compare") and written["vary"] is None
    assert result["machine"] == compare.machine() and written["machines"] == [result["machine"]]  # where it ran
    assert len(written["commit"]) == 40 or written["commit"] == "unknown"
    # Carried to another machine (scripts/study_carry.sh): the finished run only, read there, not run again.
    os.makedirs(os.path.join("runs", "compare-resume", "grpo__s2"))  # an interrupted run: not carried
    with open(run + ".result.json", "w") as f:  # as a checkout older than machine() wrote it: stamped when saved
        json.dump({k: v for k, v in result.items() if k != "machine"}, f)
    carry = [os.path.join(REPO, "scripts", "study_carry.sh"), "resume", "runs", "carried"]
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(["bash", carry[0], "save", *carry[1:]], check=True, capture_output=True, env=env)
    assert sorted(os.listdir("carried")) == ["grpo__s1", "grpo__s1.result.json"]
    missing = subprocess.run(["bash", carry[0], "save", "nothere", "runs", "elsewhere"], capture_output=True,
                             text=True, env=env)
    assert missing.returncode == 1 and "error: no study folder runs/compare-nothere" in missing.stderr
    assert not os.path.exists("elsewhere")  # nothing made for a study that is not there
    shutil.rmtree(os.path.join("runs", "compare-resume"))
    subprocess.run(["bash", carry[0], "restore", *carry[1:]], check=True, capture_output=True, env=env)
    study(2, resume=True)
    assert not os.path.exists(run + ".log")  # a run's log is written only when it runs
    with open(run + ".result.json") as f:
        assert json.load(f) == result
    # A run of a checkout older than the per-run commit, saved from that checkout (a git worktree): stamped with it.
    checkout = tmp_path / "worktree"
    shutil.copytree(os.path.join("runs", "compare-resume"), checkout / "runs" / "compare-resume")
    with open(checkout / "runs" / "compare-resume" / "grpo__s1.result.json", "w") as f:
        json.dump({k: v for k, v in result.items() if k not in ("machine", "commit")}, f)
    git = ["git", "-C", str(checkout), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "the study's code"], check=True)
    ran_at = subprocess.run(git[:3] + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout
    subprocess.run(["bash", carry[0], "save", "resume", str(checkout / "runs"), str(tmp_path / "carried")],
                   check=True, capture_output=True, env=env)
    with open(tmp_path / "carried" / "grpo__s1.result.json") as f:
        stamped = json.load(f)
    assert stamped["commit"] == ran_at.strip() != result["commit"] and stamped["machine"] == compare.machine()


def test_the_permutation_test_by_hand():
    """3 against 3: 20 splits. Fully apart, only the observed split and its mirror are as extreme (p = 2/20); equal
    groups: every split is at least as extreme as a difference of 0 (p = 1); [1, 2, 3] against [2, 3, 4]: means 1
    apart, pooled sum 15, so a split is as extreme when its first group sums to at most 6 or at least 9; counted by
    hand from the 20 sums (5, 6, 6, 6, 6, 7, 7, 7, 7, 7, 8, 8, 8, 8, 8, 9, 9, 9, 9, 10): 5 + 5 of 20."""
    from evals.stats import permutation_p, smallest_p

    assert permutation_p([0.1, 0.2, 0.3], [0.7, 0.8, 0.9]) == pytest.approx(2 / 20)
    assert smallest_p(3, 3) == pytest.approx(0.1)
    assert smallest_p(5, 5) == pytest.approx(2 / 252)
    assert permutation_p([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]) == 1.0
    assert permutation_p([1, 2, 3], [2, 3, 4]) == pytest.approx(10 / 20)
    assert smallest_p(1, 1) == 1.0  # one run a side: any test is blind
    with pytest.raises(ValueError):
        permutation_p([], [1.0])


def test_the_chance_that_few_seeds_separate_two_estimators():
    """separation_chance: at shift 0 every order of the pooled runs is equally likely, so all n above all m has chance
    1 / C(n + m, n); one run a side: P(A > B) = Phi(shift / sqrt 2), the difference of two normals; it grows with the
    shift toward 1. shift_for_chance inverts it (docs/evaluation.md quotes it for 3 seeds a side)."""
    import math
    import statistics

    from evals.stats import separation_chance, shift_for_chance

    assert separation_chance(3, 3, 0.0) == pytest.approx(1 / 20, abs=1e-9)
    assert separation_chance(5, 5, 0.0) == pytest.approx(1 / 252, abs=1e-9)
    assert separation_chance(1, 1, 1.0) == pytest.approx(statistics.NormalDist().cdf(1 / math.sqrt(2)), abs=1e-9)
    chances = [separation_chance(3, 3, shift) for shift in (0.5, 1.0, 2.0, 4.0, 8.0)]
    assert chances == sorted(chances) and chances[-1] == pytest.approx(1.0, abs=1e-6)
    shift = shift_for_chance(3, 3, 0.8)
    assert separation_chance(3, 3, shift) == pytest.approx(0.8, abs=1e-6)
    assert 2.4 < shift < 2.7  # a simulation of 20,000 draws a side gave 0.78 at a shift of 2.5


def test_the_paired_test_by_hand():
    """paired_p: three differences of one sign (1, 2, 3): of the 8 sign flips only all-plus and all-minus reach a
    mean of 2, p = 2/8; (3, -1): the flips' means are 1, -2, 2, -1, all at least 1 away from 0, p = 1; five of one
    sign: 2/32, the floor for five pairs."""
    from evals.stats import paired_p

    assert paired_p([1.0, 2.0, 3.0]) == 0.25
    assert paired_p([3.0, -1.0]) == 1.0
    assert paired_p([3.0, 1.5, 13.0, 6.0, 9.0]) == 2 / 32
    with pytest.raises(ValueError):
        paired_p([])


def test_a_runs_record_by_hand(tmp_path):
    """run_record (a step's evaluation in its own row or in the step's): evaluations at steps 0, 2 and 3; minutes
    the time/step summed up to each (0, 3 + 9 s, + 6 s); diagnostics the mean over the training steps of what the
    run logs (ESS (0.9 + 0.7 + 0.8) / 3), none for what it does not (no policy/kl), and each one's steps."""
    from evals.compare import run_record

    rows = [{"step": 0, "eval/accuracy": 0.25},
            {"step": 1, "time/step": 3.0, "policy/ess": 0.9, "policy/clip_frac": 0.0},
            {"step": 2, "time/step": 9.0, "policy/ess": 0.7, "policy/clip_frac": 0.1},
            {"step": 2, "eval/accuracy": 0.5},
            {"step": 3, "time/step": 6.0, "policy/ess": 0.8, "policy/clip_frac": 0.2, "eval/accuracy": 0.75}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record = run_record(str(tmp_path))
    assert record["evals"] == [(0, 0.25), (2, 0.5), (3, 0.75)]
    assert record["minutes"] == pytest.approx([0.0, 12 / 60, 18 / 60])
    assert record["diagnostics"] == pytest.approx({"policy/ess": 0.8, "policy/clip_frac": 0.1})
    assert record["series"] == {"policy/ess": [(1, 0.9), (2, 0.7), (3, 0.8)],
                                "policy/clip_frac": [(1, 0.0), (2, 0.1), (3, 0.2)]}


def test_a_study_names_the_commits_its_runs_ran_at(tmp_path):
    """write_study: each run's own commit; a run recorded before runs had one takes the commit of the study.json it
    was first written into (not the checkout that finishes the study); several commits are named together."""
    from evals.compare import write_study

    def study(results):
        write_study(results, None, str(tmp_path), "python -m evals.compare")
        return json.loads((tmp_path / "study.json").read_text())["commit"]

    (tmp_path / "study.json").write_text(json.dumps({"commit": "a" * 40}))
    assert study([{"algo": "grpo", "seed": 1}]) == "a" * 40
    assert study([{"algo": "grpo", "seed": 1}, {"algo": "grpo", "seed": 2, "commit": "b" * 40}]) == \
        "a" * 40 + "," + "b" * 40


def test_a_studys_figures_are_drawn_for_many_estimators(tmp_path):
    """plot and plot_vary with 12 estimators (more than the 10 default colours), with and without training minutes,
    with several seeds and with one: each writes its file."""
    from evals.compare import plot, plot_vary

    algos = [f"e{i}" for i in range(12)]
    results = [{"algo": a, "seed": s, "value": v, "evals": [[0, 0.4], [10, 0.5 + 0.01 * i + 0.001 * s]],
                "minutes": [0.0, 3.0 + s]} for i, a in enumerate(algos) for s in (1, 2) for v in ("0", "2")]
    plot_vary(results, algos, "rollout_lag", ["0", "2"], str(tmp_path))
    plot([r for r in results if r["value"] == "0"], algos, str(tmp_path))
    assert (tmp_path / "accuracy_vs_rollout_lag.png").stat().st_size > 0 and (tmp_path / "accuracy.png").stat().st_size
    for r in results:
        del r["minutes"]  # runs recorded before the minutes were: the figure against steps alone
    plot([r for r in results if r["value"] == "0"], algos, str(tmp_path))
    (tmp_path / "accuracy.png").unlink()
    plot([r for r in results if r["value"] == "0" and r["seed"] == 1], algos, str(tmp_path))  # one seed each
    assert (tmp_path / "accuracy.png").stat().st_size > 0


def test_a_study_runs_in_one_evals_compare_at_a_time(tmp_path):
    """A second evals.compare on a study in progress stops at once, naming the first's process: with --resume it would
    take the first's unfinished runs for interrupted ones and delete their folders. The lock goes with the study."""
    from evals.compare import claim_study

    with claim_study(str(tmp_path)):
        with pytest.raises(SystemExit, match=rf"in use by another evals.compare \(pid {os.getpid()}\); wait"):
            with claim_study(str(tmp_path)):
                pass
    with claim_study(str(tmp_path)):  # the first one ended: free again
        pass


def test_the_t_distribution_by_hand():
    """Closed forms: with 1 degree of freedom t is Cauchy, its 0.975 quantile tan(0.475 pi) =
    12.7062; with 2, P(T <= t) = 1/2 + t / (2 sqrt(t^2 + 2)), so the 0.975 quantile is 0.95 sqrt(2 /
    (1 - 0.95^2)) = 4.3027; with 4, the printed tables' 2.7764."""
    import math

    from evals.stats import t_cdf, t_quantile

    assert t_quantile(0.975, 1) == pytest.approx(math.tan(0.475 * math.pi), rel=1e-9)
    assert t_quantile(0.975, 2) == pytest.approx(0.95 * math.sqrt(2 / (1 - 0.95**2)), rel=1e-9)
    assert t_quantile(0.975, 4) == pytest.approx(2.7764, abs=1e-4)
    assert t_cdf(1.0, 2) == pytest.approx(0.5 + 1 / (2 * math.sqrt(3)), rel=1e-12)
    assert t_cdf(-1.0, 2) == pytest.approx(0.5 - 1 / (2 * math.sqrt(3)), rel=1e-12)
    assert t_cdf(0.0, 7) == 0.5


def test_the_paired_t_interval_by_hand():
    """Differences 1, 2, 3: mean 2, sd 1, standard error 1 / sqrt 3; the interval 2 +- 4.3027 / sqrt
    3 (2 degrees of freedom: above); t = 2 sqrt 3 against 0, whose two-sided p with 2 degrees of
    freedom is 1 - t / sqrt(t^2 + 2) = 1 - sqrt(12 / 14); against 2 (the mean itself) p = 1."""
    import math

    from evals.stats import paired_t

    summary = paired_t([1.0, 2.0, 3.0])
    half = 0.95 * math.sqrt(2 / (1 - 0.95**2)) / math.sqrt(3)
    assert (summary.mean, summary.sd, summary.n) == (2.0, 1.0, 3)
    assert summary.low == pytest.approx(2 - half, rel=1e-9)
    assert summary.high == pytest.approx(2 + half, rel=1e-9)
    assert summary.p(0.0) == pytest.approx(1 - math.sqrt(12 / 14), rel=1e-9)
    assert summary.p(2.0) == pytest.approx(1.0)
    # the interval leaves a boundary out exactly when its p is under 0.05
    assert summary.p(summary.low - 1e-6) < 0.05 < summary.p(summary.low + 1e-6)
    with pytest.raises(ValueError):
        paired_t([1.0])


def test_holms_correction_by_hand():
    """p = 0.01, 0.04, 0.03, 0.005: sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03,
    0.06, 0.04; never below the one before: 0.02, 0.03, 0.06, 0.06; back in their order."""
    from evals.stats import holm

    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    assert holm([0.01]) == pytest.approx([0.01])


def test_one_verdict_rule_for_every_claim():
    """The claim's region against the interval: differences 1, 2, 3 (interval 2 +- 2.48). Region
    above 0: the mean is inside, its p against 0 decides (0.074: cannot tell at 0.05, "agree" had it
    been adjusted under 0.05). Parity within +-5: the mean is inside, the larger of its p against -5
    and +5 decides. Region above 6: the mean is outside, its p against 6 decides and a small one
    says "disagree"."""
    import math

    from evals.stats import claim_p, paired_t, verdict

    summary = paired_t([1.0, 2.0, 3.0])
    assert claim_p(summary, 0.0, math.inf) == pytest.approx(summary.p(0.0))
    assert claim_p(summary, -5.0, 5.0) == pytest.approx(max(summary.p(-5.0), summary.p(5.0)))
    assert claim_p(summary, 6.0, math.inf) == pytest.approx(summary.p(6.0))
    assert summary.p(6.0) < 0.05
    assert verdict(summary, 0.0, math.inf, adjusted_p=0.074) == "cannot tell"
    assert verdict(summary, 0.0, math.inf, adjusted_p=0.01) == "agree"
    assert verdict(summary, 6.0, math.inf, adjusted_p=0.02) == "disagree"
    assert verdict(summary, -5.0, 5.0, adjusted_p=0.049) == "agree"


def test_the_power_of_the_paired_t_test():
    """At no effect the test rejects with its level, 0.05; the textbook's cases (G*Power's tables
    for the paired t-test, two-sided 0.05): an effect of one standard deviation is found with power
    0.803 by 10 pairs, one of half a standard deviation with 0.808 by 34; so 10 and 34 are the seeds
    those effects need for power 0.8."""
    from evals.stats import paired_t_power, seeds_needed

    assert paired_t_power(5, 0.0, 1.0) == pytest.approx(0.05, abs=1e-3)
    assert paired_t_power(10, 1.0, 1.0) == pytest.approx(0.803, abs=2e-3)
    assert paired_t_power(34, 0.5, 1.0) == pytest.approx(0.808, abs=2e-3)
    assert seeds_needed(1.0, 1.0) == 10 and seeds_needed(0.5, 1.0) == 34
    # the interval's width can ask for more: 2.262 / sqrt 10 = 0.72 sd on each side at 10 pairs, so
    # 0.5 needs more
    assert seeds_needed(1.0, 1.0, half_width=0.5) > 10


def test_eval_from_starts_the_evaluations_later(in_toy_workdir):
    """--eval_from 2 with --eval_steps 1 over 3 steps: held-out accuracy at steps 2 and 3, none
    before training (its default, 0, evaluates at step 0 too); each evaluation logs its seconds
    (time/eval)."""
    from conftest import read_metrics, run_script

    import grpo

    argv = ["--preset", "toy", "--batch_size", "8", "--num_generations", "4",
            "--micro_batch_size", "4", "--total_steps", "3", "--eval_steps", "1",
            "--eval_from", "2", "--eval_num_prompts", "8", "--run_name", "eval_from"]
    rows = read_metrics(run_script(grpo, argv))
    assert [m["step"] for m in rows if "eval/accuracy" in m] == [2, 3]
    assert all(m["time/eval"] > 0 for m in rows if "eval/accuracy" in m)


def test_the_study_plans_claims_by_hand():
    """evals.plan on two seeds made by hand: every arm's accuracy is the mean of its evaluations at
    steps 8 and 10; CTPO's clip share, 10% then 30% over the steps, lies between GRPO's 5% and
    GSPO's 40% (the inside distance min(20 - 5, 40 - 20) = 15 points on both seeds: sd 0, so p 0);
    its drift is 30 - 10 = +20 points, outside the +-5 of "stable"; SNIB 2 points above GSPO on one
    seed and 4 on the other (mean 3, sd sqrt 2)."""
    from evals import plan

    def run(accuracy, clip=0.0, late_clip=None, reward=(0.25, 0.125, 0.0625), capped=(0.5, 0.7)):
        late = clip if late_clip is None else late_clip
        series = {"policy/clip_frac": [(s, clip if s <= 5 else late) for s in range(1, 11)],
                  "reward/mean": [[s, r] for s, r in enumerate(reward, 1)],
                  "p3o/capped_frac": [(1, capped[0])] + [(s, capped[1]) for s in range(2, 11)]}
        return {"evals": [(8, accuracy - 0.01), (10, accuracy + 0.01)], "series": series}

    runs = {"grpo": {1: run(0.50, 0.05), 2: run(0.40, 0.05)},
            "gspo": {1: run(0.55, 0.40), 2: run(0.45, 0.40)},
            "ctpo": {1: run(0.60, 0.10, 0.30), 2: run(0.50, 0.10, 0.30)},
            "p3o": {1: run(0.30), 2: run(0.20)},
            "snib": {1: run(0.57, 0.02), 2: run(0.49, 0.02)},
            "grpo_on": {1: run(0.50), 2: run(0.41)}}
    assert plan.accuracy(runs["grpo"][1]) == pytest.approx(50.0)
    rows = {row["claim"].effect: row for row in plan.verdicts(runs)}
    inside = rows["ctpo clip share inside grpo's..gspo's"]
    assert inside["values"] == pytest.approx([15.0, 15.0]) and inside["p"] == 0.0
    drift = rows["ctpo clip share, steps 6-10 minus 1-5"]
    assert drift["values"] == pytest.approx([20.0, 20.0]) and drift["verdict"] == "disagree"
    snib = rows["snib - gspo, accuracy"]
    assert snib["values"] == pytest.approx([2.0, 4.0])
    assert snib["summary"].sd == pytest.approx(2**0.5)
    assert rows["p3o capped share, stale minus fresh"]["values"] == pytest.approx([20.0, 20.0])
    assert rows["grpo on-policy - off-policy, accuracy"]["values"] == pytest.approx([0.0, 1.0])
    assert len(rows) == len(plan.CLAIMS) >= 7
    assert plan.first_rollouts_shared(runs) == {1: True, 2: True}
    # another second batch for one arm: not the same rollouts
    runs["p3o"][2]["series"]["reward/mean"][1][1] = 0.5
    assert plan.first_rollouts_shared(runs) == {1: True, 2: False}


def test_the_study_reads_carried_runs_as_it_reads_its_study_files(tmp_path):
    """The finished runs carried in docs/studies/unfinished/TAG/ (one RUN.result.json each) are read
    as the same results in a study.json; the table of docs/study-plan.md says how many seeds every
    arm finished, and gives no interval before two."""
    import json

    from evals import plan

    carried = tmp_path / "unfinished"
    studies = tmp_path / "studies"
    for arm, (tag, script) in plan.ARMS.items():
        results = [{"algo": script, "seed": seed, "evals": [[8, 0.5], [10, 0.4 + 0.1 * seed]],
                    "series": {"policy/clip_frac": [[step, 0.1 * seed] for step in range(1, 11)],
                               "reward/mean": [[1, 0.25]],
                               "p3o/capped_frac": [[step, 0.5] for step in range(1, 11)]}}
                   for seed in (1, 2)]
        (carried / tag).mkdir(parents=True, exist_ok=True)
        for result in results:
            with open(carried / tag / f"{script}__s{result['seed']}.result.json", "w") as f:
                json.dump(result, f)
        (studies / f"compare-{tag}").mkdir(parents=True, exist_ok=True)
        study = studies / f"compare-{tag}" / "study.json"
        previous = json.loads(study.read_text())["results"] if study.exists() else []
        study.write_text(json.dumps({"results": previous + results}))
    assert plan.read_runs(str(carried)) == plan.read_runs(str(studies))
    assert all(set(by_seed) == {1, 2} for by_seed in plan.read_runs(str(carried)).values())
    table = plan.verdict_table(str(carried))
    assert table[0].startswith("Seeds finished by every arm: 2 (1, 2) of ")
    assert len([line for line in table if line.startswith("| ")]) == 2 + len(plan.ARMS) + 2 + len(plan.CLAIMS)
    # each arm's accuracy, the mean of steps 8 and 10: seed 1 (50 + 50) / 2, seed 2 (50 + 60) / 2
    assert "| grpo_on | 50.0, 55.0 | 52.5 | 3.5 | 50.0 | 55.0 |" in table
    # every arm's accuracy and clip share the same: 0 each seed (half-width 0), but SNIB's clip share, 10 and 20
    # points (half-width 12.706 x 5 = 63.5)
    # and the seeds it would need: t(0.975, n - 1) x 7.07 / sqrt(n) is 6.54 at n = 7 (t 2.447), 5.91 at 8 (t 2.365)
    assert table[-1] == (f"Intervals at most 6 points wide on each side: 8 of {len(plan.CLAIMS)} claims. Seeds the "
                         "others would need for it, at the spread measured here: SNIB snib clip share: 8.")
    snib_clip = "| SNIB | snib clip share | +10.0, +20.0 | +15.0 | [-48.5, +78.5] | 63.5 |"
    assert any(line.startswith(snib_clip) for line in table)
    for path in (carried / "study67").glob("*__s2.result.json"):
        path.unlink()
    assert plan.verdict_table(str(carried))[-1] == "No interval yet: fewer than two seeds finished by every arm."


def test_snibs_study_runs_by_hand(tmp_path):
    """evals.plan.snib_table on two carried SNIB runs made by hand: each seed's accuracy (the mean of steps 8 and 10),
    its training reward at its first and last step, the least group ESS and the largest KL with their steps, the
    largest log-weight spread, and the seeds under the untrained model's accuracy."""
    import json

    from evals import plan

    folder = tmp_path / "study67_snib"
    folder.mkdir()
    for seed, (at_8, at_10), kl in ((1, (0.30, 0.40), [0.1, 0.5, 0.2]), (2, (0.10, 0.00), [0.2, 3.0, 40.0])):
        series = {"reward/mean": [[1, 0.25], [2, 0.125], [3, 0.0625 * seed]],
                  "snib/ess": [[1, 0.8], [2, 0.3 / seed], [3, 0.5]],
                  "snib/raw_logweight_std": [[1, 0.5], [2, 1.0 * seed], [3, 0.7]],
                  "policy/kl": [[step, value] for step, value in zip((1, 2, 3), kl)]}
        result = {"algo": "snib", "seed": seed, "evals": [[8, at_8], [10, at_10]], "series": series}
        (folder / f"snib__s{seed}.result.json").write_text(json.dumps(result))
    assert plan.snib_table(str(tmp_path))[2:] == [
        "| 1 | 35.0% | 0.250 -> 0.062 | 0.30 (2) | 1.00 | 0.5 (2) |",
        "| 2 | 5.0% | 0.250 -> 0.125 | 0.15 (2) | 2.00 | 40 (3) |",
        "",
        f"Seeds ending under the untrained model's {plan.UNTRAINED}%: 1 of 2 (2).",
    ]


def test_snibs_stop_gradient_pilot_by_hand(tmp_path):
    """evals.plan.snib_sg_table on carried runs made by hand: the stop-gradient runs 25 and 15 points above the study's
    SNIB run of their seed (the mean of steps 8 and 10), their reward at the first and last step and largest KL, none
    under the untrained model, and the mean +20.0 with its paired t interval (sd 5 sqrt 2, t 12.706 on one degree of
    freedom: +-63.5)."""
    import json

    from evals import plan

    def carry(tag, seed, at_8, at_10, kl=(0.1, 0.2)):
        folder = tmp_path / tag
        folder.mkdir(exist_ok=True)
        series = {"reward/mean": [[1, 0.25], [10, 0.5]], "policy/kl": [[1, kl[0]], [10, kl[1]]]}
        result = {"algo": "snib", "seed": seed, "evals": [[8, at_8], [10, at_10]], "series": series}
        (folder / f"snib__s{seed}.result.json").write_text(json.dumps(result))

    carry("study67_snib", 1, 0.10, 0.10)
    carry("study67_snib", 2, 0.05, 0.15)
    carry("study67_snib_sg", 1, 0.30, 0.40, kl=(0.5, 0.2))
    table = plan.snib_sg_table(str(tmp_path))
    assert table[0] == ("Seeds finished: 1 (1). Each trained on the same first rollouts as the study's SNIB run of "
                        "its seed: yes.")
    assert table[4] == "| 1 | 35.0% | 0.250 -> 0.500 | 0.5 (1) | 10.0% | +25.0 |"
    assert table[-1] == "No interval yet: fewer than two seeds finished."
    carry("study67_snib_sg", 2, 0.20, 0.30)
    table = plan.snib_sg_table(str(tmp_path))
    assert table[5] == "| 2 | 25.0% | 0.250 -> 0.500 | 0.2 (10) | 10.0% | +15.0 |"
    assert table[7] == (f"Runs with `--kl_weight_grad false` ending under the untrained model's {plan.UNTRAINED}%: "
                        "0 of 2.")
    assert table[-1] == ("`--kl_weight_grad false` - the study's SNIB: +20.0 points, 95% interval [-43.5, +83.5] "
                         "over 2 seeds (a pilot: no verdict).")


def test_sdpos_comparison_by_hand(tmp_path):
    """evals.plan.sdpo_table on carried runs made by hand: SDPO 10 and 6 points under GRPO on-policy's same seed (the
    mean of steps 8 and 10), the teacher gap of each SDPO run's first step with a re-prompted row (not step 1's 0),
    the mean -8.0 with its paired t
    interval (sd 2 sqrt 2, t 12.706 on one degree of freedom: +-25.4), the p of t = 4 against 0 (evals/stats.py: 1 -
    2 atan(4) / pi = 0.156 on one degree of freedom), and no verdict before ten seeds."""
    import json

    from evals import plan

    def carry(tag, script, seed, at_8, at_10, reward=0.25, gap=None):
        folder = tmp_path / tag
        (folder / f"{script}__s{seed}").mkdir(parents=True, exist_ok=True)
        result = {"algo": script, "seed": seed, "evals": [[8, at_8], [10, at_10]],
                  "series": {"reward/mean": [[1, reward], [2, 0.5]]}}
        (folder / f"{script}__s{seed}.result.json").write_text(json.dumps(result))
        rows = [{"step": 1, "reward/mean": reward, "sdpo/reprompted_frac": 0.0, "sdpo/teacher_gap": 0.0}]
        rows += [{"step": 2, "sdpo/reprompted_frac": 0.5, "sdpo/teacher_gap": gap}] if gap else []
        (folder / f"{script}__s{seed}" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    carry("study67_on", "grpo", 1, 0.50, 0.60)
    carry("study67_on", "grpo", 2, 0.40, 0.50)
    carry("study67_on", "grpo", 3, 0.40, 0.50)  # no SDPO run of seed 3 yet
    carry("sdpo_smollm2", "sdpo", 1, 0.40, 0.50, gap=0.25)
    table = plan.sdpo_table(str(tmp_path))
    assert table[0] == ("Seeds finished by both: 1 (1) of 10 planned; SDPO runs finished: 1. Both trained on the same "
                        "first rollouts in each of them: yes.")
    assert table[4] == "| 1 | 45.0% | 55.0% | -10.0 | +0.250 |"
    assert table[-1] == "No interval yet: fewer than two seeds finished by both."
    carry("sdpo_smollm2", "sdpo", 2, 0.36, 0.42, reward=0.5)  # other first rollouts, no teacher gap logged
    table = plan.sdpo_table(str(tmp_path))
    assert table[0].endswith("in each of them: no.") and table[5] == "| 2 | 39.0% | 45.0% | -6.0 | - |"
    assert table[-1] == ("SDPO - GRPO: -8.0 points, 95% interval [-33.4, +17.4] over 2 seeds; claimed: > 0; p 0.156; "
                         "the rule so far (no verdict before all seeds): cannot tell.")
    for seed in range(3, plan.SEEDS + 1):  # all seeds: SDPO 10 points under GRPO each, but seed 2's 6
        carry("study67_on", "grpo", seed, 0.40, 0.50)
        carry("sdpo_smollm2", "sdpo", seed, 0.30, 0.40)
    last = plan.sdpo_table(str(tmp_path))[-1]
    assert last.startswith("SDPO - GRPO: -9.6 points") and f"over {plan.SEEDS} seeds" in last
    assert last.endswith("; verdict: disagree.")
    under = f"SDPO runs ending under the untrained model's {plan.UNTRAINED}%: "
    assert under + f"0 of {plan.SEEDS}." in plan.sdpo_table(str(tmp_path))
    carry("sdpo_smollm2", "sdpo", 3, 0.10, 0.20)  # 15%
    assert under + f"1 of {plan.SEEDS} (3)." in plan.sdpo_table(str(tmp_path))


STUB_PLAN = """
import sys, time
args = sys.argv[1:]
if args == ["--seeds"]:
    print(3)
elif args[0] == "--budget":
    sys.exit(0 if int(args[-1]) <= 2 else 1)  # the budget lets two seeds in
elif args[0] == "--commands":
    s = args[1]
    print(f"echo off {s} --jobs 1 >> calls.log")
    print(f"sleep 0.5; echo snib {s} >> calls.log")
    print(f"echo on {s} >> calls.log")
"""


def run_study_runner(folder, plan: str, cores: str):
    """scripts/study67.sh in `folder` on a stand-in evals.plan (`plan`, its source) and model builder."""
    import shutil
    import subprocess

    for package in ("evals", "common", "common/tasks", "scripts"):
        (folder / package).mkdir(parents=True, exist_ok=True)
        (folder / package / "__init__.py").write_text("")
    (folder / "evals" / "plan.py").write_text(plan)
    (folder / "common" / "tasks" / "smollm2.py").write_text("")
    shutil.copy(os.path.join(REPO, "scripts", "study67.sh"), folder / "scripts")
    return subprocess.run(["bash", "scripts/study67.sh"], cwd=folder, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "CORES": cores, "PYTHONPATH": str(folder)})


@pytest.mark.parametrize("cores", ["1", "2"])
def test_the_study_runner_keeps_the_seeds_in_order(tmp_path, cores):
    """scripts/study67.sh on stand-ins of evals.plan and the model's builder: each seed's three commands before the
    next seed, until the budget stops it. CORES=2: the off-policy study with --jobs 2, then SNIB's and GRPO
    on-policy's side by side (the on-policy one, not held up by SNIB's half second, logs first)."""
    out = run_study_runner(tmp_path, STUB_PLAN, cores)
    assert out.returncode == 0, out.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    if cores == "1":
        assert calls == ["off 1 --jobs 1", "snib 1", "on 1", "off 2 --jobs 1", "snib 2", "on 2"]
    else:
        assert calls == ["off 1 --jobs 2", "on 1", "snib 1", "off 2 --jobs 2", "on 2", "snib 2"]
    assert out.stdout.rstrip().endswith("done")


def test_the_study_runner_waits_for_both_runs_before_it_stops(tmp_path):
    """CORES=2: when SNIB's command fails at once, the runner still waits for GRPO on-policy's (here half a second)
    before it exits with the failure, so no run goes on behind it; CORES=two is refused."""
    failing = STUB_PLAN.replace('print(f"sleep 0.5; echo snib {s} >> calls.log")', 'print("exit 3")')
    failing = failing.replace('print(f"echo on {s} >> calls.log")', 'print(f"sleep 0.5; echo on {s} >> calls.log")')
    out = run_study_runner(tmp_path, failing, "2")
    assert out.returncode == 3
    assert (tmp_path / "calls.log").read_text().splitlines() == ["off 1 --jobs 2", "on 1"]
    out = run_study_runner(tmp_path, failing, "two")
    assert out.returncode == 2 and "CORES=two" in out.stderr


def test_the_study_stops_at_its_budget():
    """60 runs of 14 minutes are the 14 CPU-hours: with 54 finished a tenth seed of six fits
    exactly, with 55 it does not; before any run finishes, a seed is priced at 14 minutes a run."""
    from evals.plan import within_budget

    assert within_budget([14.0] * 54) and not within_budget([14.0] * 55)
    assert within_budget([]) and not within_budget([], budget_hours=1.0)


def test_snibs_weights_read_from_its_dumps(tmp_path):
    """One training step of two optimizer steps, G = 4, one group: first u = (0, 0, 0, 0) with
    log wbar 0 (every w 1: none changed, ESS 1); then u = (log 2, 0, 0, 0) with log wbar =
    log(5/4), so w = (8/5, 4/5, 4/5, 4/5): with eps a hair over 0.2 only 8/5 lies outside the band,
    a share of 1/4, and the group ESS (mean w = 1) is 1 / mean w^2 = 4 / (2.56 + 3 x 0.64)."""
    import math

    from evals.snib_weights import group_ess, step_rows

    (tmp_path / "stats").mkdir()
    log_wbar = math.log(5 / 4)
    dumps = [{"log_weight": torch.zeros(4), "log_wbar": torch.zeros(4)},
             {"log_weight": torch.tensor([math.log(2), 0.0, 0.0, 0.0]),
              "log_wbar": torch.full((4,), log_wbar)}]
    torch.save(dumps, tmp_path / "stats" / "step_000001.rank0.pt")
    row = {"step": 1, "reward/mean": 0.25, "policy/clip_frac": 0.125}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    (r,) = step_rows(str(tmp_path), epsilon=0.2 + 1e-6, G=4)
    assert (r["changed_first"], r["changed_last"]) == (0.0, 0.25) and r["changed"] == 0.125
    assert r["ess_min"] == pytest.approx(4 / 4.48)
    assert r["ess_mean"] == pytest.approx((1 + 4 / 4.48) / 2)
    assert r["clip_logged"] == 0.125 and r["kl"] is None
    assert group_ess(torch.tensor([4.0, 0.0, 0.0, 0.0]), 4).item() == pytest.approx(1 / 4)


def test_the_studys_progress_lists_its_finished_runs(tmp_path):
    """Two finished runs of seed 1 (GRPO off-policy, 30 and 18 minutes): both listed with their
    training minutes and evaluations' seconds, 0.8 CPU-hours, and no seed complete (four arms of six
    missing)."""
    from evals.plan import progress

    for tag, algo, seconds in (("study67", "grpo", 1800.0), ("study67_on", "grpo", 1080.0)):
        folder = tmp_path / f"compare-{tag}"
        folder.mkdir()
        result = {"algo": algo, "seed": 1, "seconds": seconds, "minutes": [10.0, 12.5],
                  "eval_seconds": [200.0, 210.0], "machine": "a CPU"}
        (folder / f"{algo}__s1.result.json").write_text(json.dumps(result))
    lines = progress(str(tmp_path))
    assert lines[0] == ("study67 grpo seed 1: 30.0 min, training 12.5, evaluations 200, 210 s "
                        "(a CPU)")
    assert lines[-1] == "2 runs, 0.80 CPU-hours; complete seeds []"
