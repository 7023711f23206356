"""Per-step time and memory of the training scripts, and of TRL's GRPOTrainer on the same work.

Runs N steps of each script in `--algo` (its `main(args)`, in a fresh process each) and reads the per-step
metrics it logs to RUN_DIR/metrics.jsonl: time/rollout, time/logprobs (old + reference passes), time/update,
time/weight_push, time/step, time/tokens_per_s and memory/peak_gib; and cpu/step, the process's CPU seconds
from one step's end to the next (time.process_time: with --threads 1 it is the step's compute, and moves
much less than wall time when other jobs share the CPU). Means skip the first --warmup steps (default 1);
peak memory is the maximum. Results go to --out as JSON and to stdout as a table.

    python benchmarks/step_time.py --algo grpo --steps 6                          # toy preset, CPU
    python benchmarks/step_time.py --algo grpo,gspo,snib,ctpo,p3o --steps 6       # siblings vs grpo.py
    python benchmarks/step_time.py --algo grpo --steps 6 --trl                    # + TRL, ratio of step times
    python benchmarks/step_time.py --algo grpo --steps 4 -- --batch_size 64 --max_completion_length 16
                                                          # anything after -- goes to the scripts (and to TRL)
    python benchmarks/step_time.py --shape qwen3 --algo grpo --trl --steps 3 --repeat 2
                                                          # Qwen3's vocabulary, lengths ~10-256 (qwen3_shape.py)

Paths (the presets' models and data, --output_dir, --out) are relative to the folder it runs in: the repository's
root, as above.

--shape qwen3 runs benchmarks/qwen3_shape.py's task (built under runs/qwen3_shape on first use) with its flags
(SHAPE_ARGS) instead of the toy preset, for the scripts and for TRL alike.

--trl also runs TRL's GRPOTrainer (not a dependency of this project: `pip install trl`; measured with
trl==1.16.0 and transformers 5.19) on the same work, every setting taken from the parsed grpo.py Args:

    model, dtype        --model loaded by TRL with model_init_kwargs dtype=--dtype; fp16=False; bf16 (autocast)
                        only where grpo.py autocasts too, ACCELERATE_MIXED_PRECISION=bf16 (TRL's default bf16=True
                        would autocast always), gradient_checkpointing=--gradient_checkpointing (TRL's default is
                        True; it recomputes every layer, so --gradient_checkpointing_every must stay 1)
    prompts             the exact prompts grpo.py sees at steps 0..N-1 (common.sampling.step_prompts), in that order,
                        shuffle_dataset=False; the text after --prompt_template / chat template (TRL tokenizes it
                        again, with the tokenizer's special tokens: the same ids for tokenizers that add no BOS,
                        such as Qwen3's and the toy's)
    rewards             the same --reward_funcs / --reward_weights functions, the dataset's other columns as kwargs
    batch geometry      num_generations=G, per_device_train_batch_size=--micro_batch_size,
                        gradient_accumulation_steps=--batch_size / --micro_batch_size, so one TRL optimizer step =
                        one RL step of --batch_size completions (needs --mini_batch_size 0 or = --batch_size and
                        --num_iterations 1), max_steps=N
    sampling            max_completion_length, temperature, top_p as given; top_k=0, no repetition penalty;
                        use_vllm=False (transformers generate, like --rollout_engine hf)
    objective           loss_type="grpo" (sequence mean of token means, as grpo.py), scale_rewards="group", beta,
                        epsilon, epsilon_high, learning_rate, lr_scheduler_type, warmup_steps, weight_decay,
                        max_grad_norm, seed; optim="adamw_torch_fused" (transformers' default;
                        torch.optim.AdamW(fused=True), as grpo.py)
    threads             torch.set_num_threads(--threads) and OMP_NUM_THREADS in both processes
    step time           TRL: on_step_begin -> on_step_end of a TrainerCallback (generation, rewards, reference
                        log-probs, the forward/backward of every micro-batch and the optimizer step; not its
                        logging); rollout = its _generate_single_turn, logprobs = its no-grad log-prob passes,
                        update = step minus its _generate_and_score_completions; cpu/step from one on_step_end
                        to the next (its logging included, as the scripts' metrics are)

Where the two do different work by design (the ratio includes it):
- grpo.py's rollout engine prefills each distinct prompt once for its G samples
  (common.logprobs.shared_prompt_cache); TRL's transformers path prefills every row.
- grpo.py's no-grad passes (reference; old log-probs when off-policy) run --logprob_batch_size rows per forward
  (the toy preset: 256, the whole batch) and compute each distinct prompt once (shared_prompt_cache); TRL runs
  them per micro-batch, every row in full. `-- --logprob_batch_size 64` measures grpo.py without the larger
  forwards.
- grpo.py samples with a seeded inverse-CDF processor (reproducible per completion), TRL with transformers'
  multinomial sampling, so completion lengths differ a little: compare tokens/s as well as step time.
- TRL's update makes the (B, T, V) logits of every micro-batch (no Liger kernel); grpo.py's log-probs and entropy
  come from the last hidden states through the head's weight in chunks of positions, at completion tokens only,
  and its micro-batches hold rows of similar length, each forward as wide as its longest row
  (common.logprobs.completion_logprobs, length_buckets).
Both take the update's own log-probs, detached, as the old log-probs when the update is on-policy.

On a shared CPU, compare cpu/step, use --repeat 3 (interleaved runs, medians) and read the load average
printed with the table.

Peak RSS stands in for a GPU's peak allocated memory, but with glibc's default allocator it measures heap
fragmentation too: the mmap threshold rises to the largest buffer freed so far, and freed (rows, V) buffers stay in
the heap. One rollout of 8 rows x 222 tokens at V = 151,936 (benchmarks/qwen3_shape.py's model) left 460-650 MB
more RSS in three runs with the default, 55 MB with the threshold fixed at 1 MiB. So compare memory with
--malloc_mmap_threshold 1048576 (MALLOC_MMAP_THRESHOLD_ in every run, scripts and TRL), and time without it (the
default, 0, is glibc's own): fixed, every large buffer is mapped and unmapped, which slowed grpo.py's rollout by
about half (its sampler makes several (rows, V) buffers per token) and TRL's much less.
"""

import argparse
import importlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from evals import ALGORITHMS as ALGOS  # noqa: E402  every estimator script at the project root

KEYS = ("time/rollout", "time/logprobs", "time/update", "time/weight_push", "time/step", "cpu/step",
        "time/tokens_per_s", "completion/length_mean")


def script_argv(a, algo: str, extra: list[str]) -> list[str]:
    preset = ["--preset", a.preset] if a.preset else []
    return preset + ["--total_steps", str(a.steps), "--eval_steps", "0", "--save_steps", "0", "--report_to", "none",
                     "--output_dir", a.output_dir, "--run_name", f"step_time_{algo}"] + extra


def run_script(algo: str, argv: list[str], threads: int) -> dict:
    """In the worker process: `algo.main(args)`, then the run's metrics.jsonl."""
    import torch

    import common.run_folder.checkpoints
    from common.args import parse_args

    torch.set_num_threads(threads)
    cpu, write = {}, common.run_folder.checkpoints.MetricsLog.write

    def timed_write(log, metrics):  # the process's CPU seconds at the end of each step
        cpu[metrics["step"]] = time.process_time()
        write(log, metrics)

    common.run_folder.checkpoints.MetricsLog.write = timed_write
    module = importlib.import_module(algo)
    run_dir = module.main(parse_args(module.Args, argv))
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        steps = [m for m in map(json.loads, f) if m["step"] > 0]
    for m in steps[:-1]:  # the last step's line is written after the final checkpoint is saved
        if m["step"] - 1 in cpu:
            m["cpu/step"] = cpu[m["step"]] - cpu[m["step"] - 1]
    return {"steps": steps, "run_dir": run_dir}


def trl_config_and_data(argv: list[str], threads: int):
    """GRPOConfig and dataset for TRL from the same parsed grpo.py Args (see the module docstring)."""
    import datasets
    import torch
    from transformers import AutoTokenizer
    from trl import GRPOConfig

    import grpo
    from common.args import parse_args
    from common.sampling import step_prompts
    from common.tasks.data import PRESET_MODULES, load_prompts, resolve_dataset

    args = parse_args(grpo.Args, argv)
    M = args.mini_batch_size or args.batch_size
    if M != args.batch_size or args.num_iterations != 1 or args.lora_r or args.tis_cap:
        raise SystemExit("--trl compares one optimizer step per RL step: use --mini_batch_size 0, --num_iterations 1, "
                         "no LoRA, no --tis_cap")
    if args.gradient_checkpointing and args.gradient_checkpointing_every > 1:
        raise SystemExit("--trl: TRL recomputes every layer under gradient checkpointing; compare with "
                         "--gradient_checkpointing_every 1")
    if args.preset:  # the toy's model and data, or the real model (common/tasks/smollm2.py), built once
        importlib.import_module(PRESET_MODULES[args.preset]).prepare_preset(args.preset)
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    data = resolve_dataset(args.dataset, args.split, args.prompt_column, args.answer_column, args.eval_split)
    train = load_prompts(tokenizer, data["path"], args.dataset_config or data["name"], data["split"],
                         prompt_column=data["prompt_column"], answer_column=data["answer_column"],
                         template=args.prompt_template, system_prompt=args.system_prompt,
                         use_chat_template=args.use_chat_template, enable_thinking=args.enable_thinking,
                         max_prompt_length=args.max_prompt_length)
    rows = [r for step in range(args.total_steps) for r in step_prompts(
        step, args.batch_size, args.num_generations, args.mini_batch_size, 1, 0, len(train), args.seed)[1]]
    picked = train.select(rows)
    columns = {c: picked[c] for c in picked.column_names if c not in ("prompt", "prompt_text", "prompt_ids")}
    dataset = datasets.Dataset.from_dict({"prompt": picked["prompt_text"], **columns})
    config = GRPOConfig(
        output_dir=os.path.join(args.output_dir, "step_time_trl"), report_to="none", save_strategy="no",
        logging_steps=1, disable_tqdm=True, seed=args.seed, data_seed=args.seed, shuffle_dataset=False,
        use_cpu=not torch.cuda.is_available(), fp16=False,  # bf16 autocast as grpo.py's (accelerate's variable)
        bf16=os.environ.get("ACCELERATE_MIXED_PRECISION") == "bf16",
        model_init_kwargs={"dtype": args.dtype}, gradient_checkpointing=args.gradient_checkpointing,
        num_generations=args.num_generations, per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=args.batch_size // args.micro_batch_size, max_steps=args.total_steps,
        max_completion_length=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
        top_k=0, repetition_penalty=1.0, use_vllm=False,
        loss_type="grpo", scale_rewards="group", beta=args.beta, epsilon=args.epsilon, epsilon_high=args.epsilon_high,
        num_iterations=1, learning_rate=args.learning_rate, lr_scheduler_type=args.lr_scheduler_type,
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        optim="adamw_torch_fused", dataloader_num_workers=0,
        reward_weights=[float(w) for w in args.reward_weights.split(",")] if args.reward_weights else None,
    )
    return args, config, dataset, tokenizer


def run_trl(argv: list[str], threads: int) -> dict:
    """In the worker process: TRL's GRPOTrainer on the work `argv` describes; per-step times and logs."""
    import torch
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from common.metrics import peak_memory_gib
    from common.tasks.reward_names import get_reward_function

    torch.set_num_threads(threads)
    args, config, dataset, tokenizer = trl_config_and_data(argv, threads)
    steps = {}

    def current(trainer) -> dict:
        return steps.setdefault(trainer.state.global_step + 1, {"time/rollout": 0.0, "time/logprobs": 0.0})

    class Timed(GRPOTrainer):
        def _generate_single_turn(self, *a, **k):
            start = time.perf_counter()
            out = super()._generate_single_turn(*a, **k)
            current(self)["time/rollout"] += time.perf_counter() - start
            return out

        def _generate_and_score_completions(self, *a, **k):  # rollout, rewards, log-prob passes: not the update
            start = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **k)
            current(self)["prepare"] = current(self).get("prepare", 0.0) + time.perf_counter() - start
            return out

        def _get_per_token_logps_and_entropies(self, *a, **k):
            start = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(*a, **k)
            if not torch.is_grad_enabled():  # old / reference passes; the update's forward has gradients
                current(self)["time/logprobs"] += time.perf_counter() - start
            return out

    class StepTimer(TrainerCallback):
        def on_step_begin(self, targs, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, targs, state, control, **kw):
            steps.setdefault(state.global_step, {})["time/step"] = time.perf_counter() - self.start
            steps[state.global_step]["memory/peak_gib"] = peak_memory_gib(targs.device)
            steps[state.global_step]["cpu_end"] = time.process_time()

        def on_log(self, targs, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                steps.setdefault(state.global_step, {})["completion/length_mean"] = logs["completions/mean_length"]

    funcs = [get_reward_function(name) for name in args.reward_funcs.split(",")]
    trainer = Timed(model=args.model, reward_funcs=funcs, args=config, train_dataset=dataset,
                    processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.train()
    out = []
    for step in sorted(s for s in steps if s <= args.total_steps):
        m = {"step": step, **steps[step]}
        if "cpu_end" in steps.get(step - 1, {}):
            m["cpu/step"] = m["cpu_end"] - steps[step - 1]["cpu_end"]
        m.pop("cpu_end", None)
        if "time/step" in m:  # the micro-batches' forward/backward and the optimizer step
            m["time/update"] = m["time/step"] - m.pop("prepare", 0.0)
        if "completion/length_mean" in m and "time/step" in m:
            m["time/tokens_per_s"] = m["completion/length_mean"] * args.batch_size / m["time/step"]
        out.append(m)
    return {"steps": out, "trl_version": importlib.import_module("trl").__version__}


def summarize(steps: list[dict], warmup: int) -> dict:
    kept = [m for m in steps if m["step"] > warmup] or steps
    summary = {"steps_averaged": len(kept)}
    for key in KEYS:
        values = [m[key] for m in kept if key in m]
        if values:
            summary[key] = sum(values) / len(values)
    peaks = [m["memory/peak_gib"] for m in steps if "memory/peak_gib" in m]
    if peaks:
        summary["memory/peak_gib"] = max(peaks)
    return summary


def spawn(kind: str, argv: list[str], threads: int, out_file: str, mmap_threshold: int,
          no_cudnn_sdp: bool = False) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--_worker", kind, "--_argv", json.dumps(argv),
           "--threads", str(threads), "--_out", out_file] + (["--no_cudnn_sdp"] if no_cudnn_sdp else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH"))))}
    if mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    start = time.time()
    proc = subprocess.run(cmd, env=env, check=False)  # in this folder: the presets' paths are relative
    if proc.returncode:
        raise SystemExit(f"{kind} failed (exit {proc.returncode}): {' '.join(cmd)}")
    with open(out_file) as f:
        result = json.load(f)
    result["wall_s"] = time.time() - start
    return result


def main():
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algo", default="grpo", help=f"comma-separated, among {','.join(ALGOS)}")
    p.add_argument("--steps", type=int, default=6, help="RL steps per run")
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the means")
    p.add_argument("--repeat", type=int, default=1,
                   help="run everything this many times, interleaved; report the median of the runs' means "
                        "(a shared CPU's noise)")
    p.add_argument("--preset", default="toy", help="the scripts' --preset ('' for none: give --model etc. after --)")
    p.add_argument("--shape", choices=["toy", "qwen3"], default="toy",
                   help="qwen3: benchmarks/qwen3_shape.py's task (Qwen3's vocabulary, varied lengths), no preset")
    p.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer on grpo.py's work")
    p.add_argument("--threads", type=int, default=1, help="torch threads in every run")
    p.add_argument("--malloc_mmap_threshold", type=int, default=0,
                   help="MALLOC_MMAP_THRESHOLD_ of every run, in bytes (0: glibc's default); 1048576 to compare memory")
    p.add_argument("--no_cudnn_sdp", action="store_true",
                   help="turn cuDNN's scaled-dot-product attention off in TRL's run too (the scripts always "
                        "turn it off: common.models.placement.padding_safe_attention)")
    p.add_argument("--output_dir", default="runs/benchmarks")
    p.add_argument("--out", default="runs/benchmarks/step_time.json")
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    p.add_argument("--_argv", help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    sys.path.insert(0, REPO)
    if a._worker:
        if a.no_cudnn_sdp:
            import torch

            torch.backends.cuda.enable_cudnn_sdp(False)
        worker_argv = json.loads(a._argv)
        if a._worker == "trl":
            result = run_trl(worker_argv, a.threads)
        else:
            result = run_script(a._worker, worker_argv, a.threads)
        with open(a._out, "w") as f:
            json.dump(result, f)
        return
    if a.trl and importlib.util.find_spec("trl") is None:
        raise SystemExit("--trl needs TRL, which this project does not depend on: pip install trl "
                         "(measured with trl==1.16.0)")
    if a.shape == "qwen3":
        from benchmarks.qwen3_shape import SHAPE_ARGS, prepare

        prepare(os.path.join("runs", "qwen3_shape"))
        a.preset, extra = "", SHAPE_ARGS + extra
    algos = a.algo.split(",")
    unknown = sorted(set(algos) - set(ALGOS))
    if unknown:
        raise SystemExit(f"--algo: unknown {unknown}; choose among {ALGOS}")
    os.makedirs(a.output_dir, exist_ok=True)
    report = {"settings": {"steps": a.steps, "warmup": a.warmup, "repeat": a.repeat, "preset": a.preset,
                           "shape": a.shape, "no_cudnn_sdp": a.no_cudnn_sdp,
                           "threads": a.threads, "malloc_mmap_threshold": a.malloc_mmap_threshold,
                           "extra": extra, "cpu_count": os.cpu_count(),
                           "load_average_at_start": os.getloadavg()}, "runs": {}}
    runs = [(algo, algo, script_argv(a, algo, extra)) for algo in algos]
    if a.trl:
        runs.append(("trl", "trl", script_argv(a, "grpo", extra)))
    for repeat in range(a.repeat):
        for name, kind, run_argv in runs:
            print(f"== {name} ({repeat + 1}/{a.repeat}): {' '.join(run_argv)}", file=sys.stderr)
            shutil.rmtree(os.path.join(a.output_dir, f"step_time_{name}"), ignore_errors=True)  # the last run's
            result = spawn(kind, run_argv, a.threads, os.path.join(a.output_dir, f"step_time_{name}.worker.json"),
                           a.malloc_mmap_threshold, a.no_cudnn_sdp)
            run = report["runs"].setdefault(name, {"argv": run_argv, "repeats": []})
            run["repeats"].append({"summary": summarize(result["steps"], a.warmup), "steps": result["steps"],
                                   "wall_s": result["wall_s"]})
            if "trl_version" in result:
                run["trl_version"] = result["trl_version"]
    report["settings"]["load_average_at_end"] = os.getloadavg()
    for run in report["runs"].values():
        run["summary"] = {key: statistics.median(r["summary"][key] for r in run["repeats"])
                          for key in run["repeats"][0]["summary"]}
    summaries = {name: r["summary"] for name, r in report["runs"].items()}
    ratios = {}
    if "grpo" in summaries:
        for name, s in summaries.items():
            if name not in ("grpo", "trl"):
                for key in ("time/step", "cpu/step"):
                    if key in s and key in summaries["grpo"]:  # cpu/step needs a step before and after
                        ratios[f"{name}/grpo {key}"] = s[key] / summaries["grpo"][key]
        if "trl" in summaries:
            for key in ("time/step", "cpu/step"):
                if key in summaries["grpo"] and key in summaries["trl"]:
                    ratios[f"grpo/trl {key}"] = summaries["grpo"][key] / summaries["trl"][key]
    report["ratios"] = ratios
    out = a.out
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)  # a bare file name: this folder
    with open(out, "w") as f:
        json.dump(report, f, indent=1)

    cols = ["time/step", "cpu/step", "time/rollout", "time/logprobs", "time/update", "time/weight_push",
            "time/tokens_per_s", "completion/length_mean", "memory/peak_gib"]
    print(f"\nmeans over steps {a.warmup + 1}..{a.steps}, median of {a.repeat} run(s) (seconds unless said), "
          f"{a.threads} torch thread(s), "
          f"load average {report['settings']['load_average_at_start'][0]:.1f} at start, "
          f"{report['settings']['load_average_at_end'][0]:.1f} at end")
    print("| run | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, s in summaries.items():
        print(f"| {name} | " + " | ".join(f"{s[c]:.3f}" if c in s else "-" for c in cols) + " |")
    for k, v in ratios.items():
        print(f"ratio {k}: {v:.3f}")
    print(f"written {out}")


if __name__ == "__main__":
    main()
