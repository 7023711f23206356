"""Seconds per weight push into a colocated vLLM engine (common/engines/vllm_engine.py; needs vLLM and a CUDA GPU).

Builds a Qwen3 with a real model's shape and random weights (no hub access needed), saves it locally, starts
VLLMEngine on it and times `push_weights(model)` --pushes times after one warm-up push, in the trainer's order
(engine asleep after generation, push, wake_up) and with the engine awake. Writes JSON, prints a line per shape.

    python benchmarks/weight_push.py --shape Qwen3-0.6B
    python benchmarks/weight_push.py --shape Qwen3-8B --pushes 5 --gpu_memory_utilization 0.4
"""

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {  # the configs of the released models (vocabulary 151,936)
    "Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       tie_word_embeddings=True),
    "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       tie_word_embeddings=True),
    "Qwen3-4B": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=True),
    "Qwen3-8B": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=False),
}
VOCAB = ["<pad>", "<eos>", "<unk>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]


def save_random_qwen3(shape: str, path: str, dtype: torch.dtype) -> torch.nn.Module:
    import tokenizers
    import transformers

    config = transformers.Qwen3Config(vocab_size=151_936, num_key_value_heads=8, head_dim=128,
                                      max_position_embeddings=40_960, rope_theta=1_000_000.0, pad_token_id=0,
                                      eos_token_id=1, bos_token_id=None, **SHAPES[shape])
    with torch.device("cuda"):
        model = transformers.Qwen3ForCausalLM(config).to(dtype)
    model.save_pretrained(path)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                        pad_token="<pad>").save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": 1, "pad_token_id": 0}, f)
    return model


def timed_push(engine, model, asleep: bool) -> float:
    if asleep:
        engine.sleep()
    torch.cuda.synchronize()
    start = time.perf_counter()
    engine.push_weights(model)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    engine.wake_up()
    return seconds


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="Qwen3-0.6B", choices=sorted(SHAPES))
    p.add_argument("--pushes", type=int, default=3)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--gpu_memory_utilization", type=float, default=0.3)
    p.add_argument("--out", default="runs/benchmarks/weight_push.json")
    a = p.parse_args()
    import accelerate

    from common.engines.vllm_engine import PUSH_BUCKET_BYTES, VLLMEngine

    with tempfile.TemporaryDirectory() as path:
        model = save_random_qwen3(a.shape, path, getattr(torch, a.dtype))
        engine = VLLMEngine(path, accelerator=accelerate.Accelerator(), gpu_memory_utilization=a.gpu_memory_utilization,
                            max_model_len=256, seed=0, dtype=a.dtype, enable_sleep_mode=True)
        engine.generate(None, [[3, 4, 5]], [0], max_tokens=4, temperature=1.0, top_p=1.0)
        timed_push(engine, model, asleep=False)  # warm-up
        asleep = [timed_push(engine, model, asleep=True) for _ in range(a.pushes)]
        awake = [timed_push(engine, model, asleep=False) for _ in range(a.pushes)]
        engine.generate(None, [[3, 4, 5]], [0], max_tokens=4, temperature=1.0, top_p=1.0)  # still serves
    gib = sum(t.numel() * t.element_size() for t in model.parameters()) / 2**30
    result = {"shape": a.shape, "dtype": a.dtype, "weights_gib": gib, "bucket_bytes": PUSH_BUCKET_BYTES,
              "seconds_per_push_asleep": sum(asleep) / len(asleep), "seconds_per_push_awake": sum(awake) / len(awake),
              "pushes": a.pushes, "device": torch.cuda.get_device_name()}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    print(f"{a.shape} ({gib:.2f} GiB {a.dtype}) on {result['device']}: "
          f"{result['seconds_per_push_asleep']:.3f} s per push in the trainer's order (asleep -> push -> wake_up), "
          f"{result['seconds_per_push_awake']:.3f} s awake ({gib / result['seconds_per_push_awake']:.1f} GiB/s)")


if __name__ == "__main__":
    main()
