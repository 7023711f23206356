"""Sharded training (DeepSpeed ZeRO, FSDP2), imported only under it: what the policy, the reference
and the generation need beyond `accelerator.prepare`."""

import contextlib

import torch


def configure_deepspeed(config: dict, micro_batch_size: int, max_grad_norm: float) -> None:
    """Without a dataloader to read it from, accelerate refuses a config whose
    train_micro_batch_size_per_gpu is unset or "auto" (the zero2 / zero3 files); and DeepSpeed clips
    the gradient itself, at its config's gradient_clipping, which accelerate sets to 1.0 when it is
    "auto" whatever the script's --max_grad_norm (a run with --max_grad_norm 5 clipped at 1). Both
    are set here from the script's flags."""
    if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        config["train_micro_batch_size_per_gpu"] = micro_batch_size
    clipping = config.get("gradient_clipping", "auto")
    if clipping == "auto":
        config["gradient_clipping"] = max_grad_norm
    elif float(clipping) != max_grad_norm:
        raise SystemExit(f"error: the DeepSpeed config clips gradients at {clipping}, but "
                         f"--max_grad_norm is {max_grad_norm}: set gradient_clipping to auto in "
                         f"the config, or pass the same value")


def prepare_sharded_reference(accelerator, ref_model):
    """The frozen reference under FSDP2 or DeepSpeed.

    FSDP2: sharded like the policy (accelerate's own fsdp2_prepare_model).
    `prepare_model(evaluation_mode=True)` would leave it whole on every process, and with
    fsdp_cpu_ram_efficient_loading (configs/accelerate/fsdp2.yaml) only process 0 has loaded its
    weights, the others holding `torch.empty` (fsdp_utils.py), so every other process would take its
    KL against garbage. Sharding it broadcasts process 0's weights, and divides its memory.
    DeepSpeed: not in accelerator._models (save_state would call DeepSpeed's save_checkpoint on it).
    Under ZeRO-3 it was loaded partitioned (zero3_init_flag): an inference engine gathers its layers
    in the forward, as TRL does."""
    if getattr(accelerator, "is_fsdp2", False):
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model

        return fsdp2_prepare_model(accelerator, ref_model).eval()
    if accelerator.state.deepspeed_plugin.zero_stage != 3:
        return ref_model.to(accelerator.device).eval()
    import deepspeed

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "bf16": {"enabled": ref_model.dtype == torch.bfloat16}}
    engine = deepspeed.initialize(model=ref_model, config=config)[0]
    engine.eval()  # DeepSpeedEngine.eval returns None
    return engine


def gathered_for_generation(accelerator, model):
    """Under ZeRO-3, the full weights gathered once for a whole generation (much faster than per
    forward); under FSDP, nothing (its forward gathers each layer)."""
    from accelerate.utils import DistributedType

    if (accelerator.distributed_type != DistributedType.DEEPSPEED
            or accelerator.state.deepspeed_plugin.zero_stage != 3):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()))
