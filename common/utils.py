"""Plumbing shared by the algorithm scripts: arguments, batch geometry, log-probs, checkpoints, metrics.

Nothing here touches advantages, ratios, clipping, KL or loss aggregation: those live in the scripts.
"""

import argparse
import contextlib
import copy
import dataclasses
import difflib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import time
import types
import typing

import torch
import yaml
from accelerate.utils import gather_object
from transformers import HfArgumentParser
from transformers.cache_utils import DynamicLayer

from common.logprobs import TokenLogprobs, fused_head, head_logprobs

# accelerate's unwrap_model imports deepspeed, whose accelerator detection then warns on every run without a GPU:
# "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it." Here the CPU is
# the plan; any other DeepSpeed message still prints.
logging.getLogger("DeepSpeed").addFilter(lambda record: "Setting accelerator to CPU" not in record.getMessage())

PRESET_NAMES = ("toy", "toy_tir")  # --preset: common/toy.py PRESETS, imported only when one is asked for
TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}


def preset_defaults(preset: str | None) -> dict:
    """The defaults a --preset sets (none without one)."""
    if preset is None:
        return {}
    from common.toy import PRESETS

    return PRESETS[preset]


def arg(default, help: str, at_least: float | None = None):
    """A field of a script's `Args` dataclass with its --help line; `at_least`: the smallest value the estimator
    accepts, checked before anything loads (common/checks.py). Parse with `parse_args` (`ArgParser`)."""
    metadata = {"help": help} if at_least is None else {"help": help, "at_least": at_least}
    return dataclasses.field(default=default, metadata=metadata)


class ArgParser(HfArgumentParser):
    """HfArgumentParser, which passes a field's metadata to argparse, less the keys that are not argparse's."""

    @staticmethod
    def _parse_dataclass_field(parser, field: dataclasses.Field):
        if "at_least" in field.metadata:
            field = copy.copy(field)
            field.metadata = types.MappingProxyType({k: v for k, v in field.metadata.items() if k != "at_least"})
        HfArgumentParser._parse_dataclass_field(parser, field)


def parse_args(args_cls, argv: list[str] | None = None):
    """HfArgumentParser with two layers of defaults under the command line: --preset NAME, then --config FILE.yaml."""
    argv = sys.argv[1:] if argv is None else list(argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    pre.add_argument("--preset")
    known, _ = pre.parse_known_args(argv)
    defaults = {}
    if known.preset is not None:
        if known.preset not in PRESET_NAMES:
            raise SystemExit(f"error: unknown --preset {known.preset!r}; choose one of {sorted(PRESET_NAMES)}")
        defaults.update(preset_defaults(known.preset))
    recipe = {}
    if known.config is not None:
        recipe = read_recipe(known.config)
        fields = {f.name for f in dataclasses.fields(args_cls)}
        unknown = sorted(set(recipe) - fields)
        if unknown:
            raise SystemExit(f"error: {known.config} sets {unknown}, which are not fields of {args_cls.__name__}")
        defaults.update(recipe)
    parser = ArgParser(args_cls)
    parser.set_defaults(**defaults)
    i = argv.index("--config") if "--config" in argv else None
    rest = argv if i is None else argv[:i] + argv[i + 2 :]
    args, unknown = parser.parse_args_into_dataclasses(args=[a for a in rest if not a.startswith("--config=")],
                                                       return_remaining_strings=True)
    if unknown:
        raise SystemExit(f"error: unknown arguments {' '.join(unknown)}{did_you_mean(unknown, args_cls)}; "
                         f"--help lists the flags")
    problems = type_problems(args, recipe, known.config)
    if problems:
        raise SystemExit("\n".join(f"error: {p}" for p in problems))
    return args


def did_you_mean(unknown: list[str], args_cls) -> str:
    flags = [f"--{f.name}" for f in dataclasses.fields(args_cls)]
    close = [m for u in unknown if u.startswith("--") for m in difflib.get_close_matches(u.split("=")[0], flags, 1)]
    return f" (did you mean {', '.join(close)}?)" if close else ""


def read_recipe(path: str) -> dict:
    """A --config YAML file: a mapping of field names to values, or a one-line error naming the file."""
    try:
        with open(path) as f:
            recipe = yaml.safe_load(f)
    except OSError as e:
        raise SystemExit(f"error: --config {path!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise SystemExit(f"error: --config {path!r} is not valid YAML{line}: {getattr(e, 'problem', e)}") from None
    if recipe is not None and not isinstance(recipe, dict):
        raise SystemExit(f"error: --config {path!r} must be a mapping of Args fields (name: value), "
                         f"not a {type(recipe).__name__}")
    return recipe or {}


def type_problems(args, recipe: dict, config: str | None) -> list[str]:
    """Values whose type is not the field's: argparse converts only strings, so a YAML list, float or mapping
    reaches the dataclass as it is (and a Literal's choices are not checked on defaults)."""
    problems = []
    for name, kind in typing.get_type_hints(type(args)).items():
        value = getattr(args, name)
        if not _is_instance(value, kind):
            source = f" (from {config})" if config and name in recipe else ""
            hint = (f"; write it as one comma-separated string, e.g. {','.join(map(str, value))}"
                    if isinstance(value, list) else "")
            problems.append(f"--{name} must be {_describe_type(kind)}, got {type(value).__name__} {value!r}"
                            f"{source}{hint}")
    return problems


def _is_instance(value, kind) -> bool:
    origin, options = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Literal:
        return value in options
    if origin in (typing.Union, types.UnionType):
        return any(_is_instance(value, option) for option in options)
    if kind is type(None):
        return value is None
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _describe_type(kind) -> str:
    origin, options = typing.get_origin(kind), typing.get_args(kind)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, options))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe_type(option) for option in options)
    return {str: "a string", int: "an integer", float: "a number", bool: "true or false",
            type(None): "null"}.get(kind, getattr(kind, "__name__", str(kind)))


def warn(message: str) -> None:
    """One line on stderr from the first process of each machine (the others would repeat it)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"warning: {message}", file=sys.stderr, flush=True)


def on_cpu() -> bool:
    """Whether this run trains on the CPU (no CUDA device, or `accelerate launch --cpu`). accelerate 1.15 joins the
    processes of a torchrun launch into one gloo group only when its state is created with cpu=True: without it,
    each of N CPU processes trains alone (state.py _prepare_backend). Note that `accelerate launch --cpu
    --num_processes N` starts one process without mpirun; launch N CPU processes with `torchrun --nproc_per_node N`
    or `accelerate launch --multi_gpu --num_processes N`."""
    return os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not torch.cuda.is_available()


def vllm_installed() -> bool:
    """vLLM can be imported and has a device (checked without loading common/vllm_engine.py when it is absent)."""
    if importlib.util.find_spec("vllm") is None:
        return False
    from common.vllm_engine import vllm_available

    return vllm_available()


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


def prepare_policy(accelerator, micro_batch_size: int, max_grad_norm: float, model, optimizer, scheduler):
    """accelerator.prepare, after telling DeepSpeed the micro-batch size and --max_grad_norm. Without a dataloader to
    read it from, accelerate refuses a config whose train_micro_batch_size_per_gpu is unset or "auto" (the zero2 /
    zero3 files); and DeepSpeed clips the gradient itself, at its config's gradient_clipping, which accelerate sets to
    1.0 when it is "auto" whatever the script's --max_grad_norm (a run with --max_grad_norm 5 clipped at 1)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        config = plugin.deepspeed_config
        if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
            config["train_micro_batch_size_per_gpu"] = micro_batch_size
        clipping = config.get("gradient_clipping", "auto")
        if clipping == "auto":
            config["gradient_clipping"] = max_grad_norm
        elif float(clipping) != max_grad_norm:
            raise SystemExit(f"error: the DeepSpeed config clips gradients at {clipping}, but --max_grad_norm is "
                             f"{max_grad_norm}: set gradient_clipping to auto in the config, or pass the same value")
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


def completion_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, num_completion_tokens: int,
                        temperature: float, entropy_grad: bool = False,
                        share_prompts: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each completion token under softmax(logits / T), and the entropy there (with its
    gradient only if `entropy_grad`: an entropy bonus needs it, logging does not).

    input_ids = [left-padded prompt | right-padded completion], (B, P + T). Returns two (B, T) in fp32, 0 at padding.
    The forward runs on the columns these rows use (the longest prompt and completion among them: rows of similar
    length together waste little, see length_buckets). Where the model's head is a plain linear map (fused_head),
    the log-probs come from the last hidden states through the head's weight, a chunk of positions at a time, and
    only at completion tokens: no (B, T, V) logits (common.logprobs.HeadLogprobs); otherwise from the logits, with
    no fp32 (B, T, V) tensor (TokenLogprobs).
    `share_prompts` (no-grad passes only): rows with the same prompt share one forward of it (shared_prompt_cache).
    """
    T, P = num_completion_tokens, input_ids.shape[1] - num_completion_tokens
    mask = attention_mask[:, P:]  # (B, T)
    T_b, P_b = max(int(mask.sum(-1).max()), 1), int(attention_mask[:, :P].sum(-1).max())  # columns in use
    input_ids, attention_mask, mask = input_ids[:, P - P_b:P + T_b], attention_mask[:, P - P_b:P + T_b], mask[:, :T_b]
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding must not shift positions
    cache = None
    if share_prompts and not torch.is_grad_enabled():
        cache = shared_prompt_cache(model, input_ids, attention_mask, P_b - 1)
    start = 0 if cache is None else P_b - 1  # with the prompts' cache, run from each prompt's last token on
    targets, head = input_ids[:, -T_b:], fused_head(model)  # (B, T_b)
    entropy_grad = entropy_grad and torch.is_grad_enabled()
    with contextlib.nullcontext() if head is None else head_logprobs(head, targets, mask, temperature, entropy_grad):
        out = model(input_ids=input_ids[:, start:], attention_mask=attention_mask, position_ids=position_ids[:, start:],
                    past_key_values=cache, use_cache=cache is not None,
                    logits_to_keep=T_b + 1).logits  # head: (B, T_b, 2); else (B, T_b + 1, V), t < T_b predicts token t
    if head is not None:
        logp, entropy = out.unbind(-1)  # (B, T_b) each
        entropy = entropy if entropy_grad else entropy.detach()  # its gradient is 0 anyway (HeadLogprobs)
    else:  # nothing else holds these logits: the backward may overwrite them with their gradient (a second
        # backward through a retained graph then fails with autograd's in-place error instead of a wrong gradient)
        logp, entropy = TokenLogprobs.apply(out, targets, temperature, entropy_grad, True)
        logp, entropy = logp * mask, entropy * mask  # (B, T_b) 0 at padding, as the head's path gives
    pad = (0, T - T_b)  # back to the batch's T columns
    return torch.nn.functional.pad(logp, pad), torch.nn.functional.pad(entropy, pad)


def length_buckets(mask: torch.Tensor, size: int, offset: int = 0) -> list[torch.Tensor]:
    """Rows offset + i of `mask` (rows, T) in groups of `size`, longest completions first: each group's forward
    runs on its own longest row's columns (completion_logprobs), so rows of similar length together waste little
    padding. A micro-batch's gradient adds up the same whatever rows it holds (the loss normalisers are the
    optimizer batch's), so only the order of floating-point sums changes."""
    order = torch.argsort(mask.sum(-1), descending=True, stable=True) + offset  # (rows,)
    return list(order.split(size))


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


@contextlib.contextmanager
def timed(metrics: dict, key: str):
    """Adds the seconds the block takes to metrics[key] (a step may sample several batches: --rollout_lag)."""
    start = time.time()
    yield
    metrics[key] = metrics.get(key, 0.0) + time.time() - start


def mean_over_processes(step_metrics: list[dict], accelerator) -> dict:
    """Each key's mean over this process's micro-batches, then over the processes that logged it (one gather: keys
    may differ by process)."""
    local = {key: sum(m[key].item() for m in step_metrics if key in m) / sum(key in m for m in step_metrics)
             for key in {key for m in step_metrics for key in m}}
    per_process = gather_object([local])
    return {key: sum(p[key] for p in per_process if key in p) / sum(key in p for p in per_process)
            for key in sorted({key for p in per_process for key in p})}


def logp_gap(sampler_logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> dict:
    """rollout/logp_gap_*: |sampler - trainer| log-prob of the same tokens at the same weights, over valid tokens."""
    gap = (sampler_logp - old_logp).abs() * mask  # (B, T)
    return {"rollout/logp_gap_mean": (gap.sum() / mask.sum().clamp(min=1)).item(),
            "rollout/logp_gap_max": gap.max().item()}


def batch_metrics(batch: dict, G: int, accelerator) -> dict:
    """reward/*, completion/* of the trained batch, over all processes."""
    lengths = batch["completion_tokens"].sum(-1).float()  # (B,)
    gathered = accelerator.gather_for_metrics({
        "reward": batch["rewards"], "length": lengths, "truncated": batch["truncated"].float(),
        "removed": (batch["mask"].sum(-1) == 0).float(),
        "zero_std": (batch["rewards"].view(-1, G).std(dim=1) == 0).float(),
        **{f"reward/{name}": r.to(accelerator.device) for name, r in batch["per_func"].items()}})
    metrics = {
        "reward/mean": gathered["reward"].mean().item(),
        "reward/std": gathered["reward"].std().item(),
        "reward/frac_zero_std_groups": gathered["zero_std"].mean().item(),
        "completion/length_mean": gathered["length"].mean().item(),
        "completion/length_max": gathered["length"].max().item(),
        "completion/truncated_frac": gathered["truncated"].mean().item(),
        "completion/removed_frac": gathered["removed"].mean().item(),
        "completion/tokens": gathered["length"].sum().item(),
    }
    for name in batch["per_func"]:
        metrics[f"reward/{name}/mean"] = gathered[f"reward/{name}"].mean().item()
        metrics[f"reward/{name}/std"] = gathered[f"reward/{name}"].std().item()
    return metrics


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


def save_checkpoint(accelerator, model, tokenizer, run_dir: str, step: int, save_total_limit: int = 0,
                    queue=None) -> str:
    """`run_dir/checkpoints/step_N/{state,model}`: accelerate state (to resume) and save_pretrained weights
    (merged for LoRA, to evaluate or serve). Written to a temporary folder and renamed when complete, so an
    interrupted save never leaves a half checkpoint behind that looks complete. Non-finite weights are never
    written; with `save_total_limit` N > 0 only the last N checkpoints are kept. Each process saves its own rows of
    the rollout `queue` (common.batching.RolloutQueue) in the state folder."""
    final = os.path.join(run_dir, "checkpoints", f"step_{step}")
    tmp = final + ".tmp"
    # each process counts its own parameters (its shards under FSDP), the sum tells every process the same
    nonfinite = sum(float((~torch.isfinite(p.detach())).sum()) for p in model.parameters())
    nonfinite = accelerator.reduce(torch.tensor(nonfinite, device=accelerator.device), "sum").item()
    if nonfinite:
        raise SystemExit(f"error: step {step}: {int(nonfinite)} weights are not finite; refusing to save them; the "
                         f"last good checkpoint is {_latest_or_none(run_dir)}")
    if accelerator.is_main_process and os.path.exists(tmp):
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    unwrapped = accelerator.unwrap_model(model)
    with quiet_saves(unwrapped):
        accelerator.save_state(os.path.join(tmp, "state"))
        if queue is not None:
            queue.save(os.path.join(tmp, "state"), accelerator.process_index)
        state_dict = accelerator.get_state_dict(model)  # gathers ZeRO-3 / FSDP shards
        if accelerator.is_main_process:
            if hasattr(unwrapped, "merge_and_unload"):  # peft: save the adapter and the merged model
                unwrapped.save_pretrained(os.path.join(tmp, "adapter"), state_dict=state_dict)
                merged = _merged_copy(unwrapped)
                merged.save_pretrained(os.path.join(tmp, "model"))
            else:
                unwrapped.save_pretrained(os.path.join(tmp, "model"), state_dict=state_dict)
            tokenizer.save_pretrained(os.path.join(tmp, "model"))
    accelerator.wait_for_everyone()  # every process's files are in tmp before it becomes the checkpoint
    if accelerator.is_main_process:
        write_manifest(tmp)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        if save_total_limit > 0:
            for old in checkpoint_steps(run_dir)[:-save_total_limit]:
                shutil.rmtree(os.path.join(run_dir, "checkpoints", f"step_{old}"))
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
        message = record.getMessage()  # accelerate's logger may prefix "[RANK 0] "
        if "Removed shared tensor" not in message:
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


def checkpoint_steps(run_dir: str) -> list[int]:
    """The steps of the run's complete checkpoints, in order (a .tmp folder is an interrupted save)."""
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(int(d.split("_")[1]) for d in os.listdir(ckpt_dir) if d.startswith("step_") and
                  not d.endswith(".tmp"))


def _latest_or_none(run_dir: str) -> str:
    steps = checkpoint_steps(run_dir)
    return os.path.join(run_dir, "checkpoints", f"step_{steps[-1]}") if steps else "none (see --save_steps)"


def _merged_copy(peft_model):
    import copy

    return copy.deepcopy(peft_model).merge_and_unload()


MANIFEST = "manifest.json"  # in each checkpoint: every file's size, written last (common.utils.save_checkpoint)


def write_manifest(ckpt: str) -> None:
    files = {os.path.relpath(os.path.join(d, f), ckpt): os.path.getsize(os.path.join(d, f))
             for d, _, names in os.walk(ckpt) for f in names}
    with open(os.path.join(ckpt, MANIFEST), "w") as f:
        json.dump(files, f, indent=0, sort_keys=True)


def checkpoint_damage(ckpt: str) -> str | None:
    """Why a checkpoint cannot be resumed from (a file missing, truncated or unreadable), or None. Checks the sizes
    its manifest recorded (older checkpoints without one: no empty file) and the header of every safetensors file."""
    from safetensors import safe_open

    try:
        with open(os.path.join(ckpt, MANIFEST)) as f:
            expected = json.load(f)
    except (OSError, ValueError):
        expected = {os.path.relpath(os.path.join(d, f), ckpt): None for d, _, names in os.walk(ckpt) for f in names}
    for name, size in sorted(expected.items()):
        path = os.path.join(ckpt, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if os.path.getsize(path) != size and (size is not None or os.path.getsize(path) == 0):
            return f"{name} has {os.path.getsize(path)} bytes, {size or 'more'} expected"
        if name.endswith(".safetensors"):
            try:
                with safe_open(path, "pt"):
                    pass
            except Exception as e:
                return f"{name} cannot be read ({str(e).splitlines()[0]})"
    return None


def find_checkpoint(path: str) -> str:
    """A checkpoint folder, or a run folder (its latest intact checkpoint, with a warning when a later one is
    damaged). A damaged checkpoint is refused with the reason: resuming from it would crash inside load_state."""
    if os.path.isdir(os.path.join(path, "state")):
        damage = checkpoint_damage(path)
        if damage:
            raise SystemExit(f"error: --resume_from {path!r} is damaged: {damage}; pass the run folder to resume "
                             f"from its latest intact checkpoint, or an earlier checkpoints/step_N")
        return path
    ckpt_dir = os.path.join(path, "checkpoints")
    steps = checkpoint_steps(path)
    if not steps:
        raise SystemExit(f"error: --resume_from {path!r} is neither a checkpoint (no state/ inside) nor a run "
                         f"folder with complete checkpoints under checkpoints/step_N")
    for step in reversed(steps):
        ckpt = os.path.join(ckpt_dir, f"step_{step}")
        damage = checkpoint_damage(ckpt)
        if damage is None:
            return ckpt
        warn(f"checkpoint {ckpt} is damaged ({damage}); trying the one before it")
    raise SystemExit(f"error: --resume_from {path!r}: every checkpoint under {ckpt_dir} is damaged")


class MetricsLog:
    """metrics.jsonl in the run folder (main process only): one line per step; on resume, the lines
    after the checkpoint's step are dropped, so the file reads as if the run had never stopped."""

    def __init__(self, run_dir: str, enabled: bool, resume_step: int = 0):
        self.path, self.enabled = os.path.join(run_dir, "metrics.jsonl"), enabled
        self.run_dir, self.start, self.resume_step = run_dir, time.time(), resume_step
        if not enabled:
            return
        kept = []  # a new run starts in an empty folder (common.checks.claim_run_dir)
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
    done = checkpoint_steps(run_dir)
    out.append(f"{'run folder:':34s}{run_dir}  (metrics.jsonl, args.json)")
    if done:
        final = os.path.join(run_dir, "checkpoints", f"step_{done[-1]}")
        out += [f"{'final checkpoint:':34s}{final}",
                f"{'evaluate it:':34s}python -m evals.run --model {os.path.join(final, 'model')} --benchmarks ...",
                f"{'resume:':34s}add --resume_from {run_dir}"]
    out.append(f"{'plot:':34s}python -m evals.plot {run_dir}")
    return "\n".join(out)
