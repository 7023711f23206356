"""A training run's set-up and end-of-step bookkeeping: everything in `main` that is not the RL
step.

`setup(args)` turns the parsed arguments into a `Run` (plain data: the processes, the run folder,
the policy and its reference, the data and rewards, the optimizer, the rollout engine, the metrics
log); `sample_batch` draws one step's batch (common/sampling.py); `end_step` pushes the new weights
to the sampler, logs, evaluates and saves. Optional features are imported where they are switched
on: vLLM, LoRA, the toy task, benchmark evaluation (common/tasks/benchmark_scoring.py).
"""

import importlib
import os
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import broadcast_object_list, gather_object, set_seed
from tqdm.auto import tqdm

from common.engines.rollout import HFEngine, single_turn, vllm_installed
from common.metrics import (
    batch_metrics,
    check_weight_sync,
    logp_gap,
    mean_grad_norm,
    mean_over_processes,
    peak_memory_gib,
    timed,
)
from common.models.placement import (
    on_cpu,
    prepare_policy,
    prepare_reference,
    sharded_parameters,
)
from common.rails.checks import brought, check_args, stop_if_nonfinite
from common.run_folder.checkpoints import MetricsLog, TrainState, save_checkpoint
from common.run_folder.run_dir import claim_run_dir, record_args
from common.sampling import RolloutQueue, round_prompts
from common.tasks.data import PRESET_MODULES, load_prompts, resolve_dataset
from common.tasks.reward_names import get_reward_function
from common.tasks.rewards import RewardError, compute_rewards


@dataclass
class Run:
    """What a training run holds; built by `setup`, read by the loop. Row counts are this
    process's."""

    args: Any
    accelerator: Accelerator
    run_dir: str
    # the policy, prepared (DDP, FSDP2 or DeepSpeed); with LoRA, a peft model
    model: torch.nn.Module
    # None without a KL term, or with LoRA (the reference is the adapter off)
    ref_model: torch.nn.Module | None
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    engine: Any  # HFEngine or VLLMEngine: generate(), push_weights(), sleep() / wake_up()
    train_data: Any  # a datasets.Dataset with prompt, prompt_ids and the reward functions' columns
    eval_data: Any  # held-out prompts for eval/accuracy, or None
    eval_sets: list  # --eval_benchmarks
    reward_funcs: list
    reward_weights: list[float] | None
    reward_columns: list[str]  # dataset columns passed to the reward functions (answer, ...)
    # --rollout_lag: the batches sampled ahead (server mode: server_client.OverlapQueue)
    queue: RolloutQueue
    train_state: TrainState  # the step, saved with the checkpoints
    log: MetricsLog
    local_rows: int  # rows of the optimizer batch (--batch_size) on this process
    local_mini: int  # rows of one mini-batch (one optimizer step) on this process
    # one optimizer step per batch, sampled by these weights: old_logp is the update's logp
    on_policy: bool
    # --eval_steps > 0 and something to evaluate on (held-out prompts or --eval_benchmarks)
    evaluating: bool
    # the rows of a prompt share one forward of it in no-grad passes: --share_prompts, unless the
    # weights are sharded (FSDP, ZeRO-3: every process must run as many forwards)
    share_prompts: bool


# the run folder of the run in progress in this process (setup sets it): for `launch`
ACTIVE_RUN: dict = {}


def where_to_resume(run_dir: str, save_steps: int) -> str:
    """The line a stopped run ends with: its last complete checkpoint and how to resume from it, or
    that there is none to resume from (a resume would be refused)."""
    from common.run_folder.checkpoints import checkpoint_steps

    steps = checkpoint_steps(run_dir)
    if steps:
        return (f"the last checkpoint of {run_dir} is checkpoints/step_{steps[-1]}; resume with "
                f"the same command and --resume_from {run_dir}")
    when = f"the first at step {save_steps}" if save_steps else "only at the end"
    return (f"{run_dir} has no checkpoint yet (--save_steps {save_steps}: {when}), so there is "
            f"nothing to resume: run the command again")


def launch(main, args_cls) -> None:
    """`python script.py ARGS`: parse the arguments and train. Ctrl-C ends with one line naming the
    last checkpoint and how to resume, not a traceback; a second Ctrl-C during the shutdown exits at
    once (checkpoints are atomic)."""
    from accelerate import PartialState

    from common.args import parse_args

    interrupted = []

    # The first Ctrl-C (or a scheduler's SIGTERM) raises KeyboardInterrupt; the second exits at
    # once, even mid-unwind.
    def on_ctrl_c(signum, _frame):
        if interrupted:
            os._exit(128 + signum)  # no waiting on a slow shutdown
        interrupted.append(signum)
        raise KeyboardInterrupt

    args = parse_args(args_cls)
    signal.signal(signal.SIGINT, on_ctrl_c)
    # what schedulers send before they kill a job: the same clean stop
    signal.signal(signal.SIGTERM, on_ctrl_c)
    try:
        main(args)
    except KeyboardInterrupt:
        how = "terminated (SIGTERM)" if interrupted[:1] == [signal.SIGTERM] else "interrupted"
        # the next signal exits at once, also where a library's handler raised
        interrupted.append(signal.SIGINT)
        signal.signal(signal.SIGINT, on_ctrl_c)
        if not PartialState().is_main_process:
            raise SystemExit(130) from None
        if "run_dir" not in ACTIVE_RUN:
            raise SystemExit(f"{how} before training started") from None
        resume = where_to_resume(ACTIVE_RUN["run_dir"], args.save_steps)
        raise SystemExit(f"{how}: {resume}") from None
    except RewardError as e:
        # A reward function broke on a sample: its message names the step, function and sample.
        # Where the user's code raised, its own traceback is printed, without our frames above it.
        if e.__cause__ is not None:
            tb = e.__cause__.__traceback__
            while (tb is not None
                   and tb.tb_frame.f_code.co_filename.startswith(os.path.dirname(__file__))):
                tb = tb.tb_next
            print("".join(traceback.format_exception(type(e.__cause__), e.__cause__, tb)),
                  file=sys.stderr)
        resume = where_to_resume(ACTIVE_RUN["run_dir"], args.save_steps)
        raise SystemExit(f"error: {e}\n{resume}") from None
    finally:
        # The run is over (done, refused or stopped). A signal from here on, such as the
        # launcher's SIGTERM to a process still exiting after another one failed, exits at once
        # and quietly: there is nothing left to stop cleanly.
        interrupted.append(signal.SIGTERM)


def setup(args) -> Run:
    """Check the arguments (before any weights load), claim the run folder, load and prepare
    everything."""
    # on a CPU-only machine accelerate forms a gloo group only when told
    state = PartialState(cpu=on_cpu())
    # a wrong flag is refused before a preset builds anything
    check_args(args, state.num_processes, files=False)
    if args.preset:
        # the toy's model and data, or the real model's (common/tasks/smollm2.py), once
        with state.main_process_first():
            importlib.import_module(PRESET_MODULES[args.preset]).prepare_preset(args.preset)
    check_args(args, state.num_processes)
    # transformers' models and schedules, once the arguments and files are checked: a refusal
    # needs neither (benchmarks/refusal_latency.py)
    from transformers import AutoTokenizer, get_scheduler

    run_name = [args.run_name or f"{args.exp_name}__{args.seed}__{int(time.time())}"]
    broadcast_object_list(run_name)  # every process writes to the same run folder
    # a new folder, or the resumed run's and its checkpoint
    run_dir, resume = claim_run_dir(args, run_name[0])
    ACTIVE_RUN["run_dir"] = run_dir
    M = args.mini_batch_size or args.batch_size
    local_rows = args.batch_size // state.num_processes
    local_mini = M // state.num_processes
    accelerator = Accelerator(
        gradient_accumulation_steps=local_mini // args.micro_batch_size,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=run_dir,  # tensorboard writes its event files here
        # the scheduler steps once per optimizer step, whatever the process count
        step_scheduler_with_optimizer=False,
    )
    set_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    # the data before the weights: prompts or benchmark questions longer
    # than --max_prompt_length cost no load
    try:
        train_data, eval_data, eval_sets = load_data(args, tokenizer, accelerator)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    found = args.problems(train_data.column_names)  # a script's checks of the data's columns
    if found:
        raise SystemExit("\n".join(f"error: {p}" for p in found))
    model, ref_model = load_models(args, tokenizer)
    reward_funcs = [get_reward_function(name) for name in args.reward_funcs.split(",")]
    reward_weights = None
    if args.reward_weights:
        reward_weights = [float(w) for w in args.reward_weights.split(",")]
    reward_columns = [c for c in train_data.column_names
                      if c not in ("prompt", "prompt_text", "prompt_ids")]

    # fused=True: one kernel per step (TRL's default)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=args.learning_rate, weight_decay=args.weight_decay, fused=True)
    optimizer_steps = args.total_steps * args.num_iterations * (args.batch_size // M)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, args.warmup_steps, optimizer_steps)
    model, optimizer, scheduler = prepare_policy(accelerator, args.micro_batch_size,
                                                 args.max_grad_norm, model, optimizer, scheduler)
    if ref_model is not None:
        ref_model = prepare_reference(accelerator, ref_model)
    train_state = TrainState()
    accelerator.register_for_checkpointing(train_state)
    if resume:
        accelerator.load_state(os.path.join(resume, "state"))
    engine = rollout_engine(args, accelerator, tokenizer, model, run_dir)

    if accelerator.is_main_process:
        project, init_kwargs = tracker_names(args.report_to, args.exp_name, run_name[0])
        accelerator.init_trackers(project, init_kwargs=init_kwargs,
                                  config={k: v for k, v in asdict(args).items() if v is not None})
        record_args(run_dir, asdict(args), train_state.step)
    log = MetricsLog(run_dir, accelerator.is_main_process, resume_step=train_state.step)
    # On-policy (one optimizer step per batch, no lag, no TIS, the trainer's old_logp), old_logp is
    # the update's own logp.detach(): no pass. --old_logp_source sampler takes the sampler's
    # log-probs as they are: no pass either.
    on_policy = (args.num_iterations == 1 and M == args.batch_size and args.rollout_lag == 0
                 and args.tis_cap == 0 and args.old_logp_source == "trainer")
    run = Run(args, accelerator, run_dir, model, ref_model, tokenizer, optimizer, scheduler, engine,
              train_data, eval_data, eval_sets, reward_funcs, reward_weights, reward_columns,
              RolloutQueue(args.rollout_lag), train_state, log, local_rows, local_mini, on_policy,
              evaluating=args.eval_steps > 0 and (eval_data is not None or len(eval_sets) > 0),
              share_prompts=args.share_prompts and not sharded_parameters(accelerator))
    # the server samples steps s+1..s+K while step s trains
    if args.server_url and args.rollout_lag > 0:
        from common.engines.server_client import overlap_queue
        run.queue = overlap_queue(run, lambda index: round_prompts(run, index, 0)[1:])
    # the batches (or requests) sampled ahead of the checkpoint's step: each process its own rows
    if resume:
        run.queue.load(os.path.join(resume, "state"), accelerator.process_index)
    if run.evaluating and train_state.step == 0 and args.eval_from <= 0:
        metrics = evaluate(run)
        log.write({"step": 0, **metrics})
        # where the learning starts, before the first step's line
        if "eval/accuracy" in metrics and accelerator.is_local_main_process:
            print(f"step 0: held-out accuracy {metrics['eval/accuracy']:.1%}", flush=True)
    return run


def tracker_names(report_to: str, exp_name: str, run_name: str) -> tuple[str, dict]:
    """The project name accelerate's init_trackers takes, and its per-tracker init_kwargs. wandb:
    the project is $WANDB_PROJECT, else the script's name (grpo), and the run's name $WANDB_NAME,
    else --run_name (accelerate alone would make each run a wandb project of its own, and the
    variables would be overridden by its arguments). Other trackers: the run's name, as before
    (tensorboard: a subfolder of the run folder)."""
    if report_to != "wandb":
        return run_name, {}
    name = os.environ.get("WANDB_NAME") or run_name
    return os.environ.get("WANDB_PROJECT") or exp_name, {"wandb": {"name": name}}


def checkpoint_layers(model, every: int = 1) -> None:
    """Gradient checkpointing on one decoder layer in `every` (the first, then each every-th): a
    checkpointed layer keeps only its input for the backward and runs its forward again there. 1 is
    transformers' own (every layer); 2 keeps about half the activations that no checkpointing keeps,
    for half the recompute. The gradients are the same at every setting (tests/test_common.py,
    tests/test_train.py)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    model.gradient_checkpointing_enable()
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index % every == 0


def load_models(args, tokenizer):
    """The policy (with a LoRA adapter when --lora_r > 0) and the frozen reference (or None); the
    tokenizer's pad."""
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16,
             "float32": torch.float32}[args.dtype]
    from transformers import AutoModelForCausalLM

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    # a model from outside: a NaN weight named at load (the reference is the same files)
    if brought(args):
        from common.rails.outside_checks import weight_problems

        weight_problems(model, args.model)
    if args.gradient_checkpointing:
        checkpoint_layers(model, args.gradient_checkpointing_every)
    ref_model = None
    if args.lora_r > 0:  # the reference is the base model: the adapter disabled, no second copy
        from common.models.lora import add_lora

        model = add_lora(model, args)
    elif args.beta > 0:
        ref_model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        ref_model = ref_model.eval().requires_grad_(False)
    return model, ref_model


def load_data(args, tokenizer, accelerator):
    """The training prompts, the held-out prompts (or None) and the --eval_benchmarks sets."""
    data = resolve_dataset(args.dataset, args.split, args.prompt_column, args.answer_column,
                           args.eval_split)
    prompt_kwargs = dict(prompt_column=data["prompt_column"], answer_column=data["answer_column"],
                         template=args.prompt_template, system_prompt=args.system_prompt,
                         use_chat_template=args.use_chat_template,
                         enable_thinking=args.enable_thinking,
                         max_prompt_length=args.max_prompt_length)
    eval_data = None
    eval_sets = []
    with accelerator.main_process_first():  # the main process fills the datasets cache first
        train_data = load_prompts(tokenizer, data["path"], args.dataset_config or data["name"],
                                  data["split"], **prompt_kwargs)
        if args.eval_steps > 0 and args.eval_benchmarks:
            from common.tasks.benchmark_scoring import load_eval_sets

            eval_sets = load_eval_sets(args.eval_benchmarks, tokenizer,
                                       use_chat_template=args.use_chat_template,
                                       enable_thinking=args.enable_thinking,
                                       system_prompt=args.system_prompt,
                                       max_prompt_length=args.max_prompt_length)
        if args.eval_steps > 0 and (args.eval_dataset or data["eval_split"]):
            spec = data
            if args.eval_dataset:
                spec = resolve_dataset(args.eval_dataset or args.dataset, args.eval_split,
                                       args.prompt_column, args.answer_column)
            eval_data = load_prompts(tokenizer, spec["path"], args.dataset_config or spec["name"],
                                     spec["eval_split"] if not args.eval_dataset else spec["split"],
                                     **prompt_kwargs)
            eval_data = eval_data.select(range(min(args.eval_num_prompts, len(eval_data))))
    return train_data, eval_data, eval_sets


def rollout_engine(args, accelerator, tokenizer, model, run_dir: str):
    """A rollout server (--server_url), vLLM (--rollout_engine vllm, or auto where installed) or
    transformers'."""
    # vllm serve (or python -m common.engines.serve) on devices of its own:
    # common/engines/server_client.py
    if args.server_url:
        from common.engines.server_client import ServerEngine
        return ServerEngine(args, accelerator, model,
                            sync_dir=os.path.join(run_dir, "server_weights"))
    if args.rollout_engine == "vllm" or (args.rollout_engine == "auto" and vllm_installed()):
        from common.engines.vllm_engine import VLLMEngine
        engine = VLLMEngine(args.model, accelerator=accelerator,
                            tensor_parallel_size=args.vllm_tensor_parallel_size,
                            gpu_memory_utilization=args.vllm_gpu_memory_utilization, seed=args.seed,
                            max_model_len=args.max_prompt_length + args.max_completion_length,
                            dtype=args.dtype)
        # a resumed or LoRA-wrapped policy differs from the files on disk
        engine.push_weights(model)
        return engine
    return HFEngine(tokenizer, accelerator, share_prompts=args.share_prompts,
                    sharded=sharded_parameters(accelerator))


def evaluate(run: Run) -> dict:
    """The --eval_benchmarks (avg@k: common/tasks/benchmark_scoring.py) and eval/accuracy: the first
    reward function's mean over greedy completions of the held-out prompts (with the run's tool
    turns), each process its slice, reduced."""
    args = run.args
    accelerator = run.accelerator
    start = time.time()
    metrics = {}
    if run.eval_sets:
        from common.tasks.benchmark_scoring import evaluate_benchmarks

        metrics.update(
            evaluate_benchmarks(run.engine, run.model, run.tokenizer, run.eval_sets,
                                n=args.eval_num_samples, seed=args.seed,
                                temperature=args.temperature if args.eval_num_samples > 1 else 0.0,
                                max_tokens=args.max_completion_length, top_p=args.top_p,
                                process_index=accelerator.process_index,
                                num_processes=accelerator.num_processes, gather=gather_object))
    if run.eval_data is None:
        return {**metrics, "time/eval": time.time() - start}
    rows = run.eval_data.select(
        range(accelerator.process_index, len(run.eval_data), accelerator.num_processes))
    greedy = dict(max_tokens=args.max_completion_length, temperature=0.0, top_p=1.0)
    run.engine.wake_up()
    if args.max_turns == 1:
        completion_ids = single_turn(run.engine, run.model, run.tokenizer, rows["prompt_ids"],
                                     [0] * len(rows), **greedy)[0]
    else:  # with the run's tool turns (common/engines/multiturn.py)
        from common.engines.multiturn import sample_completions

        completion_ids = sample_completions(run.engine, run.model, run.tokenizer,
                                            rows["prompt_ids"], [0] * len(rows),
                                            max_turns=args.max_turns, tool=args.tool,
                                            **greedy).completion_ids
    run.engine.sleep()
    texts = run.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    # the first reward function, called as in training (TRL's keyword style or positional,
    # conversational form), with the training data's columns that the held-out data has too (a
    # preset's held-out set has no `solution`)
    columns = {c: rows[c] for c in run.reward_columns if c in rows.column_names}
    correct, _ = compute_rewards(run.reward_funcs[:1], None, rows["prompt"], texts, columns,
                                 args.reward_timeout)
    stats = accelerator.reduce(
        torch.tensor([correct.sum().item(), len(correct)], device=accelerator.device), "sum")
    accuracy = (stats[0] / stats[1]).item()
    return {**metrics, "eval/accuracy": accuracy, "time/eval": time.time() - start}


def progress_bar(run: Run) -> tqdm:
    """The steps left to train (all of them, or those after the resumed checkpoint's), with a
    progress bar."""
    return tqdm(range(run.train_state.step, run.args.total_steps), initial=run.train_state.step,
                total=run.args.total_steps, disable=not run.accelerator.is_local_main_process,
                desc=run.args.exp_name)


def end_step(run: Run, step: int, step_start: float, batch, metrics: dict,
             update_metrics: list[dict], grad_norms: list, progress: tqdm) -> None:
    """After the updates of step `step` (0-based): check and push the weights to the sampler, log
    the step's metrics, evaluate and save when due. A step whose metrics are not finite stops the
    run before it is saved."""
    args = run.args
    accelerator = run.accelerator
    # sampler/trainer mismatch
    metrics.update(logp_gap(batch.sampler_logp, batch.old_logp, batch.mask))
    # a push that did not land?
    check_weight_sync(metrics["rollout/logp_gap_mean"], args.max_logp_gap, step + 1)
    with timed(metrics, "time/weight_push"):
        run.engine.push_weights(run.model)

    # means over micro-batches, then processes
    metrics.update(mean_over_processes(update_metrics, accelerator))
    metrics.update(batch_metrics(batch, args.num_generations, accelerator))
    # steps since the weights that sampled it (<= --rollout_lag)
    metrics["rollout/staleness"] = batch.staleness
    metrics.update(
        {"step": step + 1, "optim/grad_norm": mean_grad_norm(grad_norms),
         "optim/lr": run.scheduler.get_last_lr()[0], "time/step": time.time() - step_start})
    metrics["time/tokens_per_s"] = metrics["completion/tokens"] / metrics["time/step"]
    metrics["memory/peak_gib"] = max(gather_object([peak_memory_gib(accelerator.device)]))
    # a broken update is neither evaluated nor saved
    stop_if_nonfinite(metrics, run.run_dir, run.log)
    run.train_state.step = step + 1
    if run.evaluating and (step + 1) % args.eval_steps == 0 and step + 1 >= args.eval_from:
        metrics.update(evaluate(run))
        # the learning, as it happens
        if "eval/accuracy" in metrics and accelerator.is_local_main_process:
            progress.write(f"step {step + 1}: held-out accuracy {metrics['eval/accuracy']:.1%}")
    if (args.save_steps and (step + 1) % args.save_steps == 0) or step + 1 == args.total_steps:
        # a slow (network) file system shows here, not in time/step
        with timed(metrics, "time/checkpoint"):
            save_checkpoint(accelerator, run.model, run.tokenizer, run.run_dir, step + 1,
                            args.save_total_limit, run.queue)
    run.log.write(metrics)
    accelerator.log(metrics, step=step + 1)
    progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}",
                         kl=f"{metrics.get('policy/kl', 0.0):.4f}",
                         tok_s=f"{metrics['time/tokens_per_s']:.0f}")


def finish(run: Run) -> str:
    """Shut the rollout engine down (while the process groups exist), end the trackers, print the
    summary."""
    run.engine.shutdown()
    run.accelerator.end_training()
    run.log.print_summary()
    return run.run_dir
