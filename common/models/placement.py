"""Where a run's models live: the CPU or GPUs, whether vLLM can run here, sharded weights (FSDP2,
ZeRO-3), and the policy and its reference placed by accelerate (DeepSpeed and FSDP2 specifics in
common/models/sharding.py)."""

import logging
import os

import torch

# accelerate's unwrap_model imports deepspeed, whose accelerator detection then warns on every run
# without a GPU: "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable
# to detect it." Here the CPU is the plan; any other DeepSpeed message still prints.
logging.getLogger("DeepSpeed").addFilter(
    lambda record: "Setting accelerator to CPU" not in record.getMessage())


def on_cpu() -> bool:
    """Whether this run trains on the CPU (no CUDA device, or `accelerate launch --cpu`). accelerate
    1.15 joins the processes of a torchrun launch into one gloo group only when its state is created
    with cpu=True (state.py _prepare_backend); README, "Several CPU processes", says how to launch
    them."""
    forced = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    return forced or not torch.cuda.is_available()


def padding_safe_attention() -> None:
    """Turn off cuDNN's scaled-dot-product attention, process-wide. Left-padded prompts give the
    padding's query positions no key to attend to; PyTorch's other attention kernels return 0
    there, but cuDNN's returns NaN, which the next layer spreads to every real token (0 x NaN in
    the attention's weighted sum). Measured on an H100 (torch 2.11): every script's first step
    stopped with a NaN gradient norm while cuDNN's kernel was on, and ran finite with it off
    (docs/gpu.md). Without CUDA the flag is set and nothing reads it."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def sharded_parameters(accelerator) -> bool:
    """FSDP and DeepSpeed ZeRO-3 shard the parameters: every forward is then a collective, and every
    process must run the same number of them (no data-dependent extra forward, such as a shared
    prompt prefix's)."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    return kind == DistributedType.FSDP or (kind == DistributedType.DEEPSPEED
                                            and accelerator.state.deepspeed_plugin.zero_stage == 3)


def prepare_policy(accelerator, micro_batch_size: int, max_grad_norm: float, model, optimizer,
                   scheduler):
    """accelerator.prepare; under DeepSpeed, after giving its config the micro-batch size and
    --max_grad_norm (common/models/sharding.py). Also turns off the attention kernel that padding
    breaks (padding_safe_attention)."""
    padding_safe_attention()
    if getattr(accelerator.state, "deepspeed_plugin", None) is not None:
        from common.models.sharding import configure_deepspeed

        configure_deepspeed(accelerator.state.deepspeed_plugin.deepspeed_config, micro_batch_size,
                            max_grad_norm)
    return accelerator.prepare(model, optimizer, scheduler)


def prepare_reference(accelerator, ref_model):
    """The frozen reference model, placed as the policy is: sharded like it under FSDP2 and ZeRO-3
    (common/models/sharding.py), else on every process."""
    from accelerate.utils import DistributedType

    fsdp2 = getattr(accelerator, "is_fsdp2", False)
    if fsdp2 or accelerator.distributed_type == DistributedType.DEEPSPEED:
        from common.models.sharding import prepare_sharded_reference

        return prepare_sharded_reference(accelerator, ref_model)
    return accelerator.prepare_model(ref_model, evaluation_mode=True)
