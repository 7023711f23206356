"""LoRA (--lora_r > 0), imported only then: the adapter, its checks, and the merged copy a
checkpoint saves.

With LoRA the reference policy is the base model itself, the adapter disabled: no second copy of the
weights.
"""

import copy
import os

import torch
from accelerate import init_empty_weights
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM


def add_lora(model, args):
    """The policy with a trainable LoRA adapter on --lora_target_modules (the base weights
    frozen)."""
    targets = args.lora_target_modules
    targets = targets if targets == "all-linear" else targets.split(",")
    config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, target_modules=targets,
                        task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def lora_argument_problems(args) -> list[str]:
    problems = []
    if args.lora_alpha <= 0:
        problems.append(f"--lora_alpha {args.lora_alpha} must be > 0 with --lora_r {args.lora_r} "
                        f"(the update is scaled by alpha / r)")
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true"):
        # accelerate's fsdp2_prepare_model: "FSDP requires a single root module" on a peft model
        # (seen on the toy)
        problems.append(f"--lora_r {args.lora_r} with FSDP is not supported here (accelerate "
                        f"cannot wrap the peft model); launch LoRA with "
                        f"configs/accelerate/ddp.yaml or zero3.yaml")
    return problems


def lora_target_problems(args, config) -> list[str]:
    """LoRA targets against the module names of the model, built on the meta device (no weights)."""
    if args.lora_target_modules == "all-linear":
        return []
    try:
        with init_empty_weights():
            skeleton = AutoModelForCausalLM.from_config(config)
    except Exception:
        # an architecture we cannot build without its code: peft will say it at load time
        return []
    names = [name for name, _ in skeleton.named_modules()]
    missing = [t for t in args.lora_target_modules.split(",")
               if not any(n == t or n.endswith("." + t) for n in names)]
    if not missing:
        return []
    leaves = sorted({n.rsplit(".", 1)[-1] for n, m in skeleton.named_modules()
                     if isinstance(m, torch.nn.Linear)})
    return [f"--lora_target_modules: {', '.join(missing)} not in {config.model_type}; its linear "
            f"layers are {','.join(leaves)} (or pass all-linear)"]


def merged_copy(peft_model):
    """A copy of the policy with the adapter merged into the base weights (the original keeps
    training)."""
    return copy.deepcopy(peft_model).merge_and_unload()
