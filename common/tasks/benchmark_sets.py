"""Benchmarks: where each one lives on the hub, which columns hold the question and the answer, how
its prompt is written and which reward function grades it.

    BENCHMARKS["math500"]                       a Benchmark (hub id, config, split, columns, grader)
    load_benchmark("math500")                   -> list of examples {"prompt", "answer", "groups"}
    load_benchmark("aime25", "aime25.jsonl")    the same from a local file in the hub schema
    register_benchmark(Benchmark(...))          add your own

Graders are reward functions of common/tasks/math_grader.py (the
`fn(prompts, completions, answer=...)` contract), so a training reward and an evaluation score are
computed by the same code.

Each entry's "schema:" comment names what its hub id, split, columns and answer type were checked
against, and what is unconfirmed; tests/test_evals.py loads a few rows of each in that schema from
evals/fixtures/.
"""

import os
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import datasets
from huggingface_hub.errors import GatedRepoError

from common.tasks.choice_grader import LETTERS
from common.tasks.data import LOCAL_FORMATS, load_rows
from common.tasks.reward_names import get_reward_function
from common.tasks.rewards import RewardFn

MATH_TEMPLATE = "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{}."
CHOICE_TEMPLATE = ("{prompt}\nPlease reason step by step, and put the letter of "
                   "your final answer within \\boxed{}.")
GRADERS = {"math": "math_accuracy", "choice": "choice_accuracy", "toy": "toy_addition"}


@dataclass(frozen=True)
class Benchmark:
    name: str
    path: str  # hub id (or a local file, for the toy task)
    split: str
    prompt_column: str
    answer_column: str
    # several configs are concatenated, each row tagged "config"
    config: str | tuple[str, ...] | None = None
    grader: str = "math"  # math | choice | toy, or any registered reward name / "module:function"
    template: str = MATH_TEMPLATE  # the user message; {prompt} is the question (with its options)
    # columns to report separately (those the data lacks are skipped)
    group_by: tuple[str, ...] = ()
    # Multiple choice: row -> (options, index of the correct one);
    # the prompt lists them as "A. ...".
    choices: Callable[[dict], tuple[list[str], int]] | None = None
    keep: Callable[[dict], bool] | None = None  # rows to evaluate on (default: all)
    gated: bool = False  # the hub asks users to accept terms first
    notes: str = field(default="", compare=False)


BENCHMARKS: dict[str, Benchmark] = {}


def register_benchmark(benchmark: Benchmark) -> Benchmark:
    """Make `benchmark` selectable by its name (registering a name again replaces it)."""
    if "{prompt}" not in benchmark.template:
        raise ValueError(f"benchmark {benchmark.name!r}: template must contain '{{prompt}}'")
    BENCHMARKS[benchmark.name] = benchmark
    return benchmark


def get_benchmark(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; known benchmarks: "
                         f"{', '.join(sorted(BENCHMARKS))}. Add your own with "
                         f"common.tasks.benchmark_sets.register_benchmark(Benchmark(...)).")
    return BENCHMARKS[name]


def get_grader(benchmark: Benchmark) -> RewardFn:
    return get_reward_function(GRADERS.get(benchmark.grader, benchmark.grader))


def format_choices(question: str, options: list[str]) -> str:
    """The question followed by one line per option: "A. ...", "B. ..." (common.tasks.math_grader
    reads them back)."""
    if len(options) > len(LETTERS):
        raise ValueError(f"at most {len(LETTERS)} options are supported, got {len(options)}")
    return question.strip() + "\n\n" + "\n".join(f"{LETTERS[i]}. {str(o).strip()}"
                                                 for i, o in enumerate(options))


def gpqa_choices(row: dict) -> tuple[list[str], int]:
    """GPQA stores the correct answer apart from three wrong ones: shuffle them with a seed taken
    from the question text, so every run (and every machine) shows the same order."""
    options = [row["Correct Answer"], row["Incorrect Answer 1"], row["Incorrect Answer 2"],
               row["Incorrect Answer 3"]]
    order = list(range(4))
    # str seeds hash with sha512: stable across processes
    random.Random(row["Question"]).shuffle(order)
    return [options[i] for i in order], order.index(0)


# "schema:" comments were checked in 2026-11 against dataset cards and code that loads each dataset,
# found by search (this project's machines cannot reach the hub); tests/test_evals.py holds the
# fixtures to those columns.
MATH_ARENA = ("MathArena set: problem_idx, problem, answer, problem_type "
              "(list of 'Algebra', 'Geometry', ...)")
for _benchmark in [
    # schema: openai/gsm8k card (configs main / socratic; test 1,319 rows; question, answer: str)
    Benchmark("gsm8k", "openai/gsm8k", "test", "question", "answer", config="main",
              notes="answer is a worked solution ending in '#### 72'"),
    # schema: the hub's eval.yaml for HuggingFaceH4/MATH-500 (default / test, problem -> answer);
    # the column types from the cards of byte-identical copies (lmms-lab/MATH500: same 400,274
    # bytes): the card itself lists none
    Benchmark("math500", "HuggingFaceH4/MATH-500", "test", "problem", "answer",
              group_by=("level", "subject"), notes="level is an int 1-5"),
    # schema: code that loads it (load_dataset("DigitalLearningGmbH/MATH-lighteval", "default",
    # split="test"), problem / level / solution / type) and the cards of copies (Dahoas/MATH: all
    # four str, test 5,000 rows)
    Benchmark("math", "DigitalLearningGmbH/MATH-lighteval", "test", "problem", "solution",
              config="default", group_by=("level", "type"),
              notes="the full 5,000-problem MATH test set; solution ends in \\boxed{}; level is "
                    "'Level 1'..'Level 5'"),
    # schema: HuggingFaceH4/aime_2024 card (train, 30 rows; id: int, answer and year: str)
    Benchmark("aime24", "HuggingFaceH4/aime_2024", "train", "problem", "answer"),
    # schema: the MathArena/aime_2025 card as a dataset survey quotes it (train, 30
    # rows, answer: int64) and code that reads its problem_type as a list; the card
    # itself was not found in the search index
    Benchmark("aime25", "MathArena/aime_2025", "train", "problem", "answer",
              group_by=("problem_type",), notes=MATH_ARENA + "; answer is an int"),
    # schema: MathArena/aime_2026 card (train, 30 rows; problem_idx, answer: int64, problem; no
    # problem_type)
    Benchmark("aime26", "MathArena/aime_2026", "train", "problem", "answer"),
    # schema: code that loads it (split test, 40 rows, columns id / question / answer); url and the
    # float answer (27.0) only from copies of it (FlippyDora/amc23 card): math-ai/amc23's own card
    # was not found
    Benchmark("amc23", "math-ai/amc23", "test", "question", "answer",
              notes="answer is a float such as 27.0"),
    # schema: MathArena/hmmt_feb_2025 card at revision c16a42a (train, 30 rows;
    # answer: str) and evalscope's hmmt25 adapter, which reads problem_type
    # (sequence of str) from the current revision
    Benchmark("hmmt_feb25", "MathArena/hmmt_feb_2025", "train", "problem", "answer",
              group_by=("problem_type",), notes=MATH_ARENA),
    # schema: only the hub id, split train and the problem / answer columns are confirmed (code that
    # loads it). UNCONFIRMED: problem_type and answer: str, assumed as MathArena's upload script
    # writes every final-answer set
    Benchmark("hmmt_nov25", "MathArena/hmmt_nov_2025", "train", "problem", "answer",
              group_by=("problem_type",), notes=MATH_ARENA),
    # schema: MathArena/brumo_2025 card (train, 30 rows; answer: str, problem_type: sequence of str)
    Benchmark("brumo25", "MathArena/brumo_2025", "train", "problem", "answer",
              group_by=("problem_type",), notes=MATH_ARENA),
    # schema: lm-evaluation-harness's gpqa tasks (Idavidrein/gpqa, dataset_name gpqa_diamond, only a
    # train split; Question, Correct Answer, Incorrect Answer 1-3) and code reading High-level
    # domain / Subdomain / Record ID
    Benchmark("gpqa_diamond", "Idavidrein/gpqa", "train", "Question", "Correct Answer",
              config="gpqa_diamond", grader="choice", template=CHOICE_TEMPLATE,
              group_by=("High-level domain",), choices=gpqa_choices, gated=True,
              notes="198 questions; the correct answer is a column of its own: options are "
                    "shuffled per question (seeded by its text)"),
    # schema: TIGER-Lab/MMLU-Pro card (test 12,032 rows + validation 70; answer: the letter,
    # answer_index: int)
    Benchmark("mmlu_pro", "TIGER-Lab/MMLU-Pro", "test", "question", "answer", grader="choice",
              template=CHOICE_TEMPLATE, group_by=("category",),
              choices=lambda row: (list(row["options"]), int(row["answer_index"])),
              notes="up to 10 options"),
]:
    register_benchmark(_benchmark)

# MMLU-Redux 2.0: one hub config per MMLU subject (100 re-annotated questions each).
MMLU_SUBJECTS = ("abstract_algebra anatomy astronomy business_ethics clinical_knowledge "
                 "college_biology college_chemistry college_computer_science college_mathematics "
                 "college_medicine college_physics computer_security conceptual_physics "
                 "econometrics electrical_engineering elementary_mathematics formal_logic "
                 "global_facts high_school_biology high_school_chemistry "
                 "high_school_computer_science high_school_european_history high_school_geography "
                 "high_school_government_and_politics high_school_macroeconomics "
                 "high_school_mathematics high_school_microeconomics high_school_physics "
                 "high_school_psychology high_school_statistics high_school_us_history "
                 "high_school_world_history human_aging human_sexuality international_law "
                 "jurisprudence logical_fallacies machine_learning management marketing "
                 "medical_genetics miscellaneous moral_disputes moral_scenarios nutrition "
                 "philosophy prehistory professional_accounting professional_law "
                 "professional_medicine professional_psychology public_relations security_studies "
                 "sociology us_foreign_policy virology world_religions").split()
# schema: code that loads it (evalscope's mmlu_redux adapter: test split, choices indexed by
# int(answer), error_type, correct_answer as a str such as "0"; another loader also reads source and
# potential_reason); card not found
register_benchmark(Benchmark(
    "mmlu_redux", "edinburgh-dawg/mmlu-redux-2.0", "test", "question", "answer",
    config=tuple(MMLU_SUBJECTS), grader="choice", template=CHOICE_TEMPLATE, group_by=("config",),
    choices=lambda row: (list(row["choices"]), int(row["answer"])),
    # The annotators flagged some questions as wrong (bad ground truth, no correct option, ...):
    # only those marked "ok" are scored here. Other harnesses (evalscope) score all 5,700 rows with
    # the annotators' corrections, so compare numbers only with the same choice.
    keep=lambda row: row.get("error_type", "ok") == "ok",
    notes="answer is the index of the correct choice"))

# the toy's folder, common/tasks/toy.py TOY_DIR (not imported: only the toy imports the toy)
register_benchmark(Benchmark(
    "toy", os.path.join("runs", "toy", "test.jsonl"), "train", "prompt", "answer", grader="toy",
    template="{prompt}",
    notes="held-out sums of the toy task, built by common.tasks.toy.prepare_toy"))


# ---------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------


def _is_gated(error: BaseException) -> bool:
    """A GatedRepoError (or a message that says "gated") anywhere in the exception's cause chain."""
    while error is not None:
        if isinstance(error, GatedRepoError) or re.search(r"\bgated\b", str(error), re.IGNORECASE):
            return True
        error = error.__cause__ or error.__context__
    return False


def local_file(name: str, data_dir: str) -> str:
    """`data_dir/<name>.jsonl` (or .json, .parquet, .csv): a local copy of a benchmark in its hub
    schema."""
    for ext in LOCAL_FORMATS:
        candidate = os.path.join(data_dir, name + ext)
        if os.path.isfile(candidate):
            return candidate
    raise ValueError(f"benchmark {name!r}: no file {name}.jsonl (or {', '.join(LOCAL_FORMATS)}) in "
                     f"--data_dir {data_dir!r}")


def _load_table(benchmark: Benchmark, path_override: str | None) -> datasets.Dataset:
    if path_override is not None:
        return load_rows(path_override, None, benchmark.split)
    configs = benchmark.config if isinstance(benchmark.config, tuple) else (benchmark.config,)
    try:
        tables = [load_rows(benchmark.path, config, benchmark.split) for config in configs]
    except ValueError as e:
        if _is_gated(e):
            raise ValueError(f"benchmark {benchmark.name!r}: the dataset "
                             f"{benchmark.path} is gated. To get access, accept the "
                             f"terms at https://huggingface.co/datasets/{benchmark.path} "
                             f"and run `hf auth login` (or set HF_TOKEN). Or evaluate on "
                             f"a local copy with --data_dir.") from e
        gated = (f"\nThe dataset is gated: accept the terms at "
                 f"https://huggingface.co/datasets/{benchmark.path} "
                 "and run `hf auth login` (or set HF_TOKEN).") if benchmark.gated else ""
        raise ValueError(f"benchmark {benchmark.name!r}: {str(e).splitlines()[0]}{gated}\nWithout "
                         f"access to the hub, give a local copy in the same schema: --data_dir DIR "
                         f"(reads DIR/{benchmark.name}.jsonl) or --benchmarks "
                         f"{benchmark.name}=FILE.") from e
    if len(tables) == 1:
        return tables[0]
    return datasets.concatenate_datasets(
        [t.add_column("config", [c] * len(t)) for c, t in zip(configs, tables)])


def load_benchmark(name: str | Benchmark, path_override: str | None = None,
                   data_dir: str | None = None) -> list[dict]:
    """The benchmark's questions as {"prompt", "answer", "groups"}; `prompt` is the question (with
    its options "A. ..." for multiple choice) before the template, `answer` what the grader compares
    with, `groups` {column: [values]} for the group_by columns the data has.

    Read from the hub, or from `path_override` / `data_dir/<name>.jsonl` in the hub's schema.
    """
    benchmark = name if isinstance(name, Benchmark) else get_benchmark(name)
    if path_override is None and data_dir:
        path_override = local_file(benchmark.name, data_dir)
    table = _load_table(benchmark, path_override)
    where = path_override or benchmark.path
    for column in (benchmark.prompt_column, benchmark.answer_column):
        if column not in table.column_names:
            raise ValueError(f"benchmark {benchmark.name!r}: {where} has no column {column!r}; its "
                             f"columns are {table.column_names}")
    group_columns = [c for c in benchmark.group_by if c in table.column_names]
    examples = []
    for row in table:
        if benchmark.keep is not None and not benchmark.keep(row):
            continue
        if benchmark.choices is not None:
            options, correct = benchmark.choices(row)
            prompt = format_choices(row[benchmark.prompt_column], options)
            answer = LETTERS[correct]
        else:
            prompt = row[benchmark.prompt_column]
            answer = str(row[benchmark.answer_column])
        groups = {c: [str(v) for v in (row[c] if isinstance(row[c], list) else [row[c]])]
                  for c in group_columns}
        examples.append({"prompt": prompt, "answer": answer, "groups": groups})
    if not examples:
        raise ValueError(f"benchmark {benchmark.name!r}: no questions in {where}")
    return examples


def benchmark_problems(spec: str, flag: str, data_dir: str | None = None) -> list[str]:
    """Names must be registered; a local copy (NAME=FILE, --data_dir) must exist and load with the
    benchmark's columns. Copies on the hub are checked when they load (the hub is not reachable from
    every machine)."""
    problems = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, path = item.partition("=")
        try:
            get_benchmark(name)
            if path and not os.path.isfile(path):
                problems.append(f"{flag} {item}: no such file {path!r}; NAME=FILE reads a local "
                                f"copy in the hub schema")
                continue
            copy = path or (local_file(name, data_dir) if data_dir else None)
            if copy:
                load_benchmark(name, copy)
        except ValueError as e:
            problems.append(f"{flag}: {str(e).splitlines()[0]}")
    return problems


def hub_benchmarks(spec: str, data_dir: str | None = None) -> list[str]:
    """The hub ids of the benchmarks in `spec` that have no local copy (NAME=FILE, --data_dir): what
    an evaluation would download."""
    ids = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, path = item.partition("=")
        if path or data_dir or name not in BENCHMARKS:
            continue
        benchmark = BENCHMARKS[name]
        if not os.path.exists(benchmark.path):
            ids.append(benchmark.path)
    return ids
