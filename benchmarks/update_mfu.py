"""The policy update at the sizes users train: Qwen3-0.6B / 1.7B / 4B with random weights (no download), one
optimizer step of grpo.py's update on rows of full length, timed. Trainer only: no rollouts, as prime-rl's
trainer benchmarks measure it.

    python benchmarks/update_mfu.py --size 0.6b --tokens 2048 --rows 8                # one GPU, full fine-tuning
    python benchmarks/update_mfu.py --size 4b --tokens 2048 --rows 8 --lora_r 16      # LoRA r 16
    python benchmarks/update_mfu.py --size tiny --tokens 64 --rows 2 --device cpu    # the CPU rehearsal
    python benchmarks/update_mfu.py --size 0.6b --tokens 768 --rows 8 --nograd scripts   # a reference pass
    python benchmarks/update_mfu.py --size 0.6b --tokens 768 --rows 8 --nograd logits    # the same, TRL's way
    python benchmarks/update_mfu.py --size 0.6b --save runs/qwen3_0.6b \
        --tokenizer_from runs/qwen3_shape/model          # a model folder for the scripts (qwen3_shape.py's tokenizer)

Each step is what grpo.py's loop does for one micro-batch: common.logprobs.completion_logprobs with gradient (the
chunked LM head), grpo.compute_loss (on-policy: old_logp is the update's own, detached; beta 0), backward, gradient
clipping and AdamW (fused on a GPU). A row is `--prompt_tokens` prompt tokens then `--tokens - --prompt_tokens`
completion tokens, all valid (random ids: a random-weight model's completions run to the length limit anyway).
`--nograd scripts` times instead the no-grad log-prob pass the scripts take for the reference's and the old
log-probs (common.sampling.logprobs_of: the chunked head, no entropy; every row here has a prompt of its own, so
none is shared), `--nograd logits` the same log-probs as TRL computes them (the whole logits, then a log-softmax a
row at a time); their MFU counts 2 x N (a forward).
Reports, over the steps after `--warmup`:

    seconds per step, trainer tokens/s (rows x tokens / seconds)
    MFU = 6 x N x tokens/s / peak, N the parameters the forward and backward pass through (the model's, less the
          input embedding, which is a lookup; LoRA: the base model's too, as the gradient flows through it),
          peak the device's dense bf16 FLOP/s (--peak_tflops, default 989: an H100 SXM or H200)
    peak memory (torch.cuda.max_memory_allocated), and with --profile, one more step under torch.profiler: the
    GPU's idle fraction (1 - the union of its kernels' time over the step's wall time) and the table of the ops that
    took the most device time (printed, and in the JSON as profile_top_ops)

Published dimensions (the models' config.json on the hub): hidden size, layers, attention heads / KV heads, head
size 128, MLP size, vocabulary 151,936, tied embeddings for 0.6B, 1.7B and 4B.
"""

import argparse
import json
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# (hidden, layers, heads, kv heads, MLP, max positions) of Qwen/Qwen3-{0.6B,1.7B,4B}; "tiny" rehearses on a CPU.
SIZES = {
    "0.6b": (1024, 28, 16, 8, 3072, 40960),
    "1.7b": (2048, 28, 16, 8, 6144, 40960),
    "4b": (2560, 36, 32, 8, 9728, 40960),
    "tiny": (64, 2, 2, 1, 128, 4096),
}
VOCAB = 151_936
PROFILE_ROWS = 25  # ops in --profile's table


def build_model(size: str, dtype: torch.dtype, device: str, lora_r: int, vocab: int = VOCAB):
    """A Qwen3 of the published dimensions with random weights, on `device` in `dtype` (and LoRA r on every linear
    layer when lora_r > 0)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden, layers, heads, kv_heads, mlp, positions = SIZES[size]
    head_dim = 32 if size == "tiny" else 128
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         intermediate_size=mlp, max_position_embeddings=positions, tie_word_embeddings=True,
                         attn_implementation="sdpa", dtype=dtype)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    if lora_r > 0:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear", lora_dropout=0.0)
        model = get_peft_model(model, lora)
    return model


def path_parameters(model) -> int:
    """The parameters a forward and backward pass through: all of them less the input embedding (a lookup). A tied
    LM head is the embedding's matrix, and counts once, as the head's matmul."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    total = sum(p.numel() for p in model.parameters())
    return total if head is embedding else total - embedding.numel()


def timed(step, a) -> float:
    """Seconds per call of `step`: the mean of a.steps calls after a.warmup, the device synchronised around each."""
    cuda = a.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(a.warmup + a.steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - start)
    return sum(times) / len(times)


def profiled_step(step) -> tuple[float | None, str]:
    """One call of `step` under torch.profiler: the GPU's idle share, 1 - (the union of the CUDA kernels' time) /
    (the step's wall time), None without CUDA; and the table of the ops that took the most time (self time on the
    device, or on the CPU without CUDA), their top PROFILE_ROWS."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    wall_us = (time.perf_counter() - start) * 1e6
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=sort_by, row_limit=PROFILE_ROWS)
    if not cuda:
        return None, table
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for a, b in kernels:  # the union of the intervals
        if b <= end:
            continue
        busy += b - max(a, end)
        end = b
    return max(0.0, 1 - busy / wall_us), table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="0.6b")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per row, prompt and completion")
    p.add_argument("--prompt_tokens", type=int, default=256)
    p.add_argument("--rows", type=int, default=8, help="rows per forward/backward (a micro-batch)")
    p.add_argument("--vocab", type=int, default=VOCAB, help="vocabulary (Qwen3's; smaller only to rehearse)")
    p.add_argument("--lora_r", type=int, default=0, help="LoRA rank; 0: full fine-tuning")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--gradient_checkpointing", action="store_true")
    p.add_argument("--gradient_checkpointing_every", type=int, default=1,
                   help="with --gradient_checkpointing: one decoder layer in K recomputed (the scripts' flag)")
    p.add_argument("--cudnn_sdp", action="store_true",
                   help="leave cuDNN's attention on (the scripts turn it off: common.models.placement."
                        "padding_safe_attention), to time what it would gain on rows without padding")
    p.add_argument("--peak_tflops", type=float, default=989.0, help="the device's dense bf16 peak (H100/H200: 989)")
    p.add_argument("--profile", action="store_true",
                   help="one more step under torch.profiler: the GPU's idle share and the ops that took the most time")
    p.add_argument("--chunk_elements", type=int, default=0,
                   help="positions x vocabulary of one chunk of the LM head's log-probs (common.logprobs "
                        "LOGPROB_CHUNK_ELEMENTS; 0: as the scripts have it), to time larger chunks on a GPU")
    p.add_argument("--nograd", choices=["", "scripts", "logits"], default="",
                   help="time a no-grad log-prob pass instead of the update: the scripts' (the reference's and the "
                        "old log-probs' pass: the chunked head, no entropy), or logits (the whole logits, then a "
                        "log-softmax a row at a time: TRL's selective_log_softmax in bf16)")
    p.add_argument("--out", default="", help="write the result as JSON here")
    p.add_argument("--save", default="", help="only save the random-weight model (and no LoRA) to this folder")
    p.add_argument("--tokenizer_from", default="", help="with --save: the tokenizer of this folder saved beside it")
    a = p.parse_args(argv)
    if a.prompt_tokens >= a.tokens:
        raise SystemExit(f"--prompt_tokens {a.prompt_tokens} must be under --tokens {a.tokens}")
    if a.gradient_checkpointing_every < 1:
        raise SystemExit(f"--gradient_checkpointing_every {a.gradient_checkpointing_every} must be at least 1")

    import common.logprobs
    import grpo
    from common.logprobs import completion_logprobs
    from common.models.placement import padding_safe_attention
    from common.run import checkpoint_layers

    dtype = getattr(torch, a.dtype)
    if a.save:  # a model folder for the scripts (benchmarks/step_time.py -- --model FOLDER)
        build_model(a.size, dtype, a.device, 0, a.vocab).save_pretrained(a.save)
        if a.tokenizer_from:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(a.tokenizer_from).save_pretrained(a.save)
        print(f"saved a random-weight Qwen3-{a.size} to {a.save}")
        return {"saved": a.save}
    model = build_model(a.size, dtype, a.device, a.lora_r, a.vocab)
    if a.gradient_checkpointing:
        checkpoint_layers(model, a.gradient_checkpointing_every)
    if a.cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(True)
    else:  # as every script's prepare_policy
        padding_safe_attention()
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = a.device.startswith("cuda")
    optimizer = torch.optim.AdamW(trainable, lr=1e-6, fused=fused)
    args = grpo.Args(num_generations=a.rows, beta=0.0, max_completion_length=a.tokens - a.prompt_tokens)
    T = a.tokens - a.prompt_tokens
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(2, a.vocab, (a.rows, a.tokens), generator=generator).to(a.device)
    attention = torch.ones_like(input_ids)
    mask = attention[:, a.prompt_tokens:]
    advantages = torch.randn(a.rows, generator=generator).to(a.device)

    def step():
        logp, _ = completion_logprobs(model, input_ids, attention, T, 1.0)
        loss, _ = grpo.compute_loss(logp, logp.detach(), None, advantages, mask, args)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    last_logp = []  # --nograd: the last pass's log-probs, summed after the timing (the two ways must agree)

    def nograd_pass():
        with torch.no_grad():
            if a.nograd == "scripts":  # common.sampling.logprobs_of's call
                logp, _ = completion_logprobs(model, input_ids, attention, T, 1.0, with_entropy=False)
            else:
                from benchmarks.logprobs_memory import rowwise_completion_logprobs

                logp, _ = rowwise_completion_logprobs(model, input_ids, attention, T, 1.0)
        last_logp[:] = [logp]  # no host sync inside the timed pass

    if a.nograd:
        model.eval()

    default_chunk = common.logprobs.LOGPROB_CHUNK_ELEMENTS
    common.logprobs.LOGPROB_CHUNK_ELEMENTS = a.chunk_elements or default_chunk
    try:
        measured = nograd_pass if a.nograd else step
        seconds = timed(measured, a)
        idle, top_ops = profiled_step(measured) if a.profile else (None, "")
    finally:  # the module's value again for whoever imports it next (tests run this in-process)
        common.logprobs.LOGPROB_CHUNK_ELEMENTS = default_chunk
    tokens_per_s = a.rows * a.tokens / seconds
    n = path_parameters(model)
    flops = 2 if a.nograd else 6  # per parameter and token: a forward, or a forward and a backward
    result = {
        "size": a.size, "lora_r": a.lora_r, "dtype": a.dtype, "device": a.device,
        "device_name": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu",
        "rows": a.rows, "tokens": a.tokens, "prompt_tokens": a.prompt_tokens, "steps": a.steps,
        "gradient_checkpointing": a.gradient_checkpointing,
        "gradient_checkpointing_every": a.gradient_checkpointing_every if a.gradient_checkpointing else 0,
        "cudnn_sdp": a.cudnn_sdp,
        "path_parameters": n, "trainable_parameters": sum(p.numel() for p in trainable),
        "seconds_per_step": seconds, "tokens_per_s": tokens_per_s,
        "nograd": a.nograd, "logp_sum": float((last_logp[0] * mask).sum()) if last_logp else None,
        "mfu": flops * n * tokens_per_s / (a.peak_tflops * 1e12) if a.device.startswith("cuda") else None,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if a.device.startswith("cuda") else None,
        "gpu_idle_fraction": idle, "chunk_elements": a.chunk_elements or default_chunk,
        "profile_top_ops": top_ops,
    }
    mfu = "-" if result["mfu"] is None else f"{100 * result['mfu']:.1f}%"
    memory = "-" if result["peak_memory_gib"] is None else f"{result['peak_memory_gib']:.1f} GiB"
    idle = "-" if result["gpu_idle_fraction"] is None else f"{100 * result['gpu_idle_fraction']:.1f}%"
    what = f"no-grad pass ({a.nograd})" if a.nograd else f"LoRA r {a.lora_r}" if a.lora_r else "full"
    print(f"Qwen3-{a.size} {what}, {a.rows} x {a.tokens} tokens, "
          f"{a.dtype} on {result['device_name']}: {seconds:.3f} s/step, {tokens_per_s:,.0f} tokens/s, MFU {mfu}, "
          f"peak {memory}, GPU idle {idle} (N = {n / 1e9:.2f}B)")
    if top_ops:
        print(top_ops)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
