"""Benchmark evaluation as a library: avg@k and pass@k of a model on benchmark sets, and the
held-out accuracy the training scripts log (--eval_benchmarks, eval_steps). The command line around
it is evals/run.py.

    avg@k  = mean_q (1/k) sum_j score_qj              mean accuracy over k samples per question
    pass@k = mean_q [1 - C(n - c_q, k) / C(n, k)]     unbiased estimate from n >= k samples (Chen
                                                      et al. 2021, arXiv:2107.03374), c_q of them
                                                      correct

Each completion has its own seed, sample_seed(seed, 0, question, sample), so a result does not
depend on the engine's batching or on the number of processes. Graders are the training rewards
(common/tasks/rewards.py). In a training loop: `load_eval_sets` once, then `evaluate_benchmarks`
every eval_steps (see its docstring).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from common.engines.rollout import sample_seed
from common.tasks.data import format_prompt
from common.tasks.rewards import compute_rewards

# ---------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """P(at least one of k samples drawn without replacement from n is correct), c of the n correct.

    1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i): no huge binomials.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def k_values(n: int) -> list[int]:
    """The k of pass@k to report: powers of two below n, and n."""
    return sorted({2**i for i in range(n.bit_length()) if 2**i < n} | {n})


def _stats(scores: list[list[float]], n: int) -> dict:
    """avg@n and pass@k over questions; a sample scoring above 0.5 counts as correct for pass@k."""
    correct = [sum(s > 0.5 for s in row) for row in scores]
    stats = {"num_questions": len(scores),
             f"avg@{n}": sum(sum(row) / n for row in scores) / len(scores)}
    for k in k_values(n):
        stats[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(scores)
    return stats


def summarize(eval_set: "EvalSet", records: list[dict], n: int) -> dict:
    """One benchmark's results from the records of all its questions (any order)."""
    records = sorted(records, key=lambda r: r["index"])
    if [r["index"] for r in records] != list(range(len(eval_set.examples))):
        raise ValueError(f"{eval_set.name}: expected one record per question")
    summary = {"path": eval_set.path, **_stats([r["scores"] for r in records], n),
               "length_mean": sum(sum(r["lengths"]) for r in records) / (n * len(records)),
               "truncated_frac": sum(sum(r["truncated"]) for r in records) / (n * len(records)),
               "groups": {}}
    for column in sorted({c for e in eval_set.examples for c in e["groups"]}):
        values = sorted({v for e in eval_set.examples for v in e["groups"].get(column, [])})
        summary["groups"][column] = {
            value: _stats([r["scores"] for r, e in zip(records, eval_set.examples)
                           if value in e["groups"].get(column, [])], n) for value in values}
    summary["questions"] = [{"index": r["index"], "answer": e["answer"], "scores": r["scores"]}
                            for r, e in zip(records, eval_set.examples)]
    return summary


def flat_metrics(name: str, summary: dict, n: int) -> dict[str, float]:
    """`eval/<benchmark>/avg@n`, `eval/<benchmark>/pass@n` and the same per group,
    `eval/<benchmark>/<column>=<value>/...`."""
    keys = [f"avg@{n}", f"pass@{n}"]
    metrics = {f"eval/{name}/{k}": summary[k] for k in keys}
    for column, values in summary["groups"].items():
        for value, stats in values.items():
            group = f"{column}={value}".replace(" ", "_").replace("/", "_")
            metrics.update({f"eval/{name}/{group}/{k}": stats[k] for k in keys})
    return metrics


# ---------------------------------------------------------------------------
# Generation and grading
# ---------------------------------------------------------------------------


@dataclass
class EvalSet:
    """A benchmark's questions, formatted and tokenized for one tokenizer."""
    name: str
    benchmark: Any  # common.tasks.benchmark_sets.Benchmark
    path: str  # where the questions came from
    examples: list[dict]  # {"prompt", "answer", "groups", "prompt_text", "prompt_ids"}


def prepare_eval_set(name: str, tokenizer, *, path_override: str | None = None,
                     data_dir: str | None = None, use_chat_template: bool = True,
                     enable_thinking: bool = False, system_prompt: str = "", max_questions: int = 0,
                     max_prompt_length: int | None = None) -> EvalSet:
    # benchmark runs only
    from common.tasks.benchmark_sets import get_benchmark, load_benchmark, local_file

    benchmark = get_benchmark(name)
    if path_override is None and data_dir:
        path_override = local_file(name, data_dir)
    examples = load_benchmark(benchmark, path_override)
    if max_questions:
        examples = examples[:max_questions]
    for e in examples:
        e["prompt_text"] = format_prompt(tokenizer, e["prompt"], benchmark.template, system_prompt,
                                         use_chat_template, enable_thinking)
        add_special_tokens = not (use_chat_template and tokenizer.chat_template)
        tokenized = tokenizer(e["prompt_text"], add_special_tokens=add_special_tokens)
        e["prompt_ids"] = tokenized["input_ids"]
    longest = max(len(e["prompt_ids"]) for e in examples)
    if max_prompt_length is not None and longest > max_prompt_length:
        raise ValueError(f"benchmark {name!r} has prompts of up to {longest} tokens, more than "
                         f"--max_prompt_length {max_prompt_length}; raise it (questions are not "
                         f"dropped from a benchmark)")
    return EvalSet(name, benchmark, path_override or benchmark.path, examples)


def load_eval_sets(spec: str, tokenizer, data_dir: str | None = None, **kwargs) -> list[EvalSet]:
    """`"math500,aime25=/data/aime25.jsonl"` -> one EvalSet per name (NAME=FILE: read a local
    copy)."""
    eval_sets = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, path = item.partition("=")
        eval_sets.append(
            prepare_eval_set(name, tokenizer, path_override=path or None, data_dir=data_dir,
                             **kwargs))
    return eval_sets


def run_eval_set(engine, model, tokenizer, eval_set: EvalSet, *, n: int, temperature: float,
                 max_tokens: int, top_p: float = 1.0, seed: int = 0, batch_size: int = 256,
                 process_index: int = 0, num_processes: int = 1, keep_completions: bool = False,
                 progress: bool = False) -> list[dict]:
    """Sample and grade n completions for this process's questions (every num_processes-th one).

    Returns one record per question: {"index", "scores", "lengths", "truncated"} (+ "completions").
    Every process makes the same number of engine calls (ZeRO-3 / FSDP generation is collective):
    the shorter slices are padded with a repeated question whose results are dropped.
    """
    if n < 1:
        raise ValueError(f"n (samples per question) must be at least 1, got {n}")
    num_questions = len(eval_set.examples)
    mine = list(range(process_index, num_questions, num_processes))
    per_process = math.ceil(num_questions / num_processes)
    padded = mine + [mine[0] if mine else 0] * (per_process - len(mine))
    requests = [(q, j) for q in padded for j in range(n)]  # (question, sample)
    from common.tasks.benchmark_sets import get_grader

    grader = get_grader(eval_set.benchmark)
    completions = []
    lengths = []
    truncated = []
    scores = []
    chunks = range(0, len(requests), batch_size)
    for start in tqdm(chunks, desc=eval_set.name, disable=not progress):
        chunk = requests[start : start + batch_size]
        examples = [eval_set.examples[q] for q, _ in chunk]
        ids, _ = engine.generate(model, [e["prompt_ids"] for e in examples],
                                 [sample_seed(seed, 0, q, j) for q, j in chunk],
                                 max_tokens=max_tokens, temperature=temperature, top_p=top_p)
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
        rewards, _ = compute_rewards([grader], None, [e["prompt"] for e in examples], texts,
                                     {"answer": [e["answer"] for e in examples]})
        completions += texts
        scores += rewards.tolist()
        lengths += [len(c) for c in ids]
        truncated += [not c or c[-1] != tokenizer.eos_token_id for c in ids]
    records = []
    for i, q in enumerate(mine):  # the padding comes after these
        rows = slice(i * n, (i + 1) * n)
        record = {"index": q, "scores": scores[rows], "lengths": lengths[rows],
                  "truncated": truncated[rows]}
        if keep_completions:
            record["completions"] = completions[rows]
        records.append(record)
    return records


def evaluate_benchmarks(engine, model, tokenizer, eval_sets: list[EvalSet], *, n: int,
                        temperature: float, max_tokens: int, top_p: float = 1.0, seed: int = 0,
                        batch_size: int = 256, process_index: int = 0, num_processes: int = 1,
                        gather: Callable[[list], list] | None = None) -> dict[str, float]:
    """avg@n and pass@n of each benchmark (and of its groups), as flat metrics
    `eval/<benchmark>/avg@<n>`.

    With several processes each one generates for its own slice of the questions; `gather`
    concatenates a list over processes (accelerate.utils.gather_object), and every process returns
    the same metrics. In a training script (the sets loaded once, before the loop, with
    `load_eval_sets`):

        metrics.update(evaluate_benchmarks(engine, model, tokenizer, eval_sets, n=...,
                                           temperature=..., max_tokens=..., seed=args.seed,
                                           process_index=accelerator.process_index,
                                           num_processes=accelerator.num_processes,
                                           gather=gather_object))
    """
    metrics = {}
    if not eval_sets:
        return metrics
    engine.wake_up()
    for eval_set in eval_sets:
        records = run_eval_set(engine, model, tokenizer, eval_set, n=n, temperature=temperature,
                               max_tokens=max_tokens, top_p=top_p, seed=seed, batch_size=batch_size,
                               process_index=process_index, num_processes=num_processes)
        records = gather(records) if gather is not None else records
        metrics.update(flat_metrics(eval_set.name, summarize(eval_set, records, n), n))
    engine.sleep()
    return metrics
