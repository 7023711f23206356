"""Peak memory of completion log-probs: naive fp32 log-softmax vs per-row (before issue 6) vs lean (common/logprobs.py).

Each (variant, dtype, pass) runs in a fresh subprocess on a random one-layer Qwen3 with Qwen3's vocabulary
(V = 151,936, hidden 64, so the (B, T, V) head dominates everything else), and reports the growth of the
process's peak resident set (resource.getrusage ru_maxrss) over its level just before the call:

    train   completion_logprobs with gradient, then backward of sum(logp) + sum(entropy) (the update pass;
            --entropy_grad 0 drops the entropy term, as grpo.py does)
    nograd  completion_logprobs under torch.no_grad (the old_logp / ref_logp passes)

Variants:
    naive   log_softmax(logits.float() / T) over the whole (B, T, V) at once, then gather
    rowwise the implementation before issue 6: the same, one row (T, V) at a time
    lean    common.logprobs.completion_logprobs: for this Qwen3, the chunked LM head (common/logprobs.py
            HeadLogprobs): no (B, T + 1, V) logits at all; for heads it cannot replace, TokenLogprobs on the
            model's logits (chunks of positions, custom backward writing the gradient into the logits)
    lean_logp  the same without the entropy (with_entropy=False): what the scripts' no-grad passes run, which
            read only the log-probs

The naive and rowwise variants make the (B, T + 1, V) logits in the model's dtype (the table prints their size).

    python benchmarks/logprobs_memory.py                        # B=2, T=1024, fp32 and bf16 -> JSON + table
    python benchmarks/logprobs_memory.py --batch 4 --length 2048 --dtypes bfloat16
    python benchmarks/logprobs_memory.py --batch 8 --length 256 --modes nograd --variants lean,lean_logp
"""

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.logprobs import completion_logprobs
from common.logprobs import textbook_logprobs as naive_completion_logprobs

QWEN3_VOCAB = 151_936


def rowwise_completion_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature,
                                entropy_grad=False):
    """common/logprobs.py before issue 6: the naive form one row at a time."""
    T = num_completion_tokens
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   logits_to_keep=T + 1).logits[:, :-1]  # (B, T, V)
    targets = input_ids[:, -T:]  # (B, T)
    logp, entropy = [], []
    for row_logits, row_targets in zip(logits, targets):
        row_logp = torch.log_softmax(row_logits.float() / temperature, dim=-1)  # (T, V)
        logp.append(row_logp.gather(-1, row_targets[:, None])[:, 0])
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy.append(-(row_logp.exp() * row_logp).sum(-1))
    return torch.stack(logp), torch.stack(entropy)


VARIANTS = {"naive": naive_completion_logprobs, "rowwise": rowwise_completion_logprobs, "lean": completion_logprobs,
            "lean_logp": functools.partial(completion_logprobs, with_entropy=False)}


def tiny_model(vocab_size: int, dtype: torch.dtype, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=32768,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return Qwen3ForCausalLM(config).to(dtype)


def make_batch(vocab_size: int, batch: int, prompt_len: int, length: int, seed: int = 0):
    """[left-padded prompt | right-padded completion] with random tokens; row i is i * 3 tokens shorter at each end."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, vocab_size, (batch, prompt_len + length), generator=g)
    attention_mask = torch.ones_like(input_ids)
    for i in range(batch):
        pad = min(3 * i, prompt_len - 1)
        attention_mask[i, :pad] = 0
        input_ids[i, :pad] = 0
        cut = min(3 * i, length - 1)
        if cut:
            attention_mask[i, -cut:] = 0
            input_ids[i, -cut:] = 0
    mask = attention_mask[:, -length:]
    return input_ids, attention_mask, mask


def maxrss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def worker(a) -> dict:
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    model = tiny_model(a.vocab, dtype)
    input_ids, attention_mask, mask = make_batch(a.vocab, a.batch, a.prompt_length, a.length)
    fn = VARIANTS[a.variant]
    baseline = maxrss_gib()
    start = time.perf_counter()
    if a.mode == "nograd":
        with torch.no_grad():
            logp, entropy = fn(model, input_ids, attention_mask, a.length, a.temperature)
    else:
        logp, entropy = fn(model, input_ids, attention_mask, a.length, a.temperature, entropy_grad=bool(a.entropy_grad))
        loss = (logp * mask).sum() + ((entropy * mask).sum() if a.entropy_grad else 0.0)
        loss.backward()
    seconds = time.perf_counter() - start
    peak = maxrss_gib()
    return {"variant": a.variant, "dtype": a.dtype, "mode": a.mode, "baseline_gib": baseline, "peak_gib": peak,
            "delta_gib": peak - baseline, "seconds": seconds, "logp_sum": float((logp * mask).sum())}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=QWEN3_VOCAB)
    p.add_argument("--batch", type=int, default=2, help="rows per forward (a micro-batch)")
    p.add_argument("--length", type=int, default=1024, help="completion tokens T")
    p.add_argument("--prompt_length", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--entropy_grad", type=int, default=1, help="1: backward through the entropy too (P3O's bonus)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--variants", default="naive,rowwise,lean,lean_logp")
    p.add_argument("--modes", default="train,nograd")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="runs/benchmarks/logprobs_memory.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--dtype", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        print(json.dumps(worker(a)))
        return

    results = []
    for dtype in a.dtypes.split(","):
        for mode in a.modes.split(","):
            for variant in a.variants.split(","):
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--variant", variant, "--dtype", dtype,
                       "--mode", mode] + [f"--{k}={getattr(a, k)}" for k in
                                          ("vocab", "batch", "length", "prompt_length", "temperature", "entropy_grad",
                                           "threads")]
                env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
                out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
                if out.returncode:
                    row = {"variant": variant, "dtype": dtype, "mode": mode,
                           "error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
                else:
                    row = json.loads(out.stdout.strip().splitlines()[-1])
                results.append(row)
                print(json.dumps(row), file=sys.stderr)
    element = {"float32": 4, "bfloat16": 2, "float16": 2}
    setup = {k: getattr(a, k) for k in ("vocab", "batch", "length", "prompt_length", "temperature", "entropy_grad",
                                        "threads")}
    setup["logits_gib"] = {d: a.batch * (a.length + 1) * a.vocab * element[d] / 2**30 for d in a.dtypes.split(",")}
    setup["fp32_btv_gib"] = a.batch * a.length * a.vocab * 4 / 2**30
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"setup": setup, "results": results}, f, indent=1)

    print(f"\nV={a.vocab}, B={a.batch}, T={a.length}: an fp32 (B, T, V) is {setup['fp32_btv_gib']:.2f} GiB; "
          f"peak RSS growth over the level before the call (GiB), seconds under --threads {a.threads}")
    print("| dtype | pass | logits (GiB) | " + " | ".join(f"{v} GiB | {v} s" for v in a.variants.split(",")) + " |")
    print("|---" * (3 + 2 * len(a.variants.split(","))) + "|")
    for dtype in a.dtypes.split(","):
        for mode in a.modes.split(","):
            cells = []
            for variant in a.variants.split(","):
                r = next(r for r in results if (r["variant"], r["dtype"], r["mode"]) == (variant, dtype, mode))
                ok = "error" not in r
                cells += [f"{r['delta_gib']:.2f}", f"{r['seconds']:.2f}"] if ok else ["error", r["error"][:40]]
            print(f"| {dtype} | {mode} | {setup['logits_gib'][dtype]:.2f} | " + " | ".join(cells) + " |")
    print(f"\nwritten {a.out}")


if __name__ == "__main__":
    main()
