"""Where the policy and the reference live. The CPU or GPUs, sharded (FSDP2, ZeRO) or whole, and
with a LoRA adapter."""
