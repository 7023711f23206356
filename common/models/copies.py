"""A frozen second copy of the policy's weights that follows it (sdpo.py's base and EMA
self-teacher), made and moved alike whether the weights are whole, FSDP2's shards or ZeRO-3's
partitions: a deepcopy of sharded weights is refused (FSDP2) or copies empty partitions (ZeRO-3)."""

import copy

import torch

from common.models.placement import prepare_reference, sharded_parameters


def frozen_copy(run, policy):
    """A frozen copy of the policy's current weights (a resumed run's too), placed as the reference
    is. Whole weights: a deepcopy. Sharded: a second model loaded from the policy's files
    (--model) and sharded like it (common/models/sharding.py), then given the policy's weights;
    TRL builds its teacher from the files too."""
    accelerator = run.accelerator
    if not sharded_parameters(accelerator):
        return copy.deepcopy(policy).eval().requires_grad_(False)
    if not (getattr(accelerator, "is_fsdp2", False) or accelerator.distributed_type == "DEEPSPEED"):
        raise SystemExit("error: a copy of FSDP1's flat parameters is not supported: launch with "
                         "configs/accelerate/fsdp2.yaml (FSDP2) or zero3.yaml")
    from transformers import AutoModelForCausalLM

    second = AutoModelForCausalLM.from_pretrained(run.args.model, dtype=policy.dtype)
    if run.args.lora_r > 0:  # the policy is a peft model: the copy takes the same adapter
        from common.models.lora import add_lora

        second = add_lora(second, run.args)
    second = prepare_reference(accelerator, second.eval().requires_grad_(False))
    move_toward(accelerator, second, policy, 1.0)
    return second


@torch.no_grad()
def move_toward(accelerator, target, source, rate: float) -> None:
    """target += rate (source - target), parameter by parameter (rate 1: a copy). Whole tensors and
    FSDP2's shards move where they are, each process its own; ZeRO-3's partitions are gathered,
    moved on the first process and partitioned again, as TRL's SyncRefModelCallback does."""
    if getattr(accelerator, "is_fsdp2", False):
        from torch.distributed.fsdp import FSDPModule

        for module in [*target.modules(), *source.modules()]:
            if isinstance(module, FSDPModule):
                module.reshard()  # the root module keeps its whole weights after a forward
    pairs = list(zip(target.parameters(), source.parameters(), strict=True))
    zero3 = accelerator.distributed_type == "DEEPSPEED" and sharded_parameters(accelerator)
    if not zero3:
        for t, s in pairs:
            t.lerp_(s, rate)
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters([p for pair in pairs for p in pair], modifier_rank=0):
        if accelerator.is_main_process:
            for t, s in pairs:
                t.lerp_(s, rate)
