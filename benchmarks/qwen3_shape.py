"""A Qwen3-shaped task for benchmarks/step_time.py --shape qwen3: Qwen3's vocabulary (151,936 tokens), a body small
enough for a CPU, and completions whose lengths vary widely, as real rollouts do. Built locally (no hub).

    model       Qwen3ForCausalLM, V = 151,936, hidden 128, 2 layers, 4 heads of 32 (2 KV heads), MLP 384, an untied
                head (as Qwen3-8B and larger), fp32 (this CPU has no bf16 matrix units). The head is 19.4M of its 39.3M
                parameters (the embedding the other 19.4M), so the vocabulary dominates the step.
    lengths     hidden dimension 0 is a constant (every embedding holds C there and no layer writes to it), and only
                EOS's head row reads it: P(EOS) is about 1 / MEAN_LENGTH at every position whatever the context, so
                completion lengths are roughly geometric (mean ~MEAN_LENGTH, many short, some at the cap of 256).
    tokenizer   word-level: <pad>, <eos>, the characters 0-9 + =, then filler words w15 ... up to V tokens
    prompts     sums of 4-12 two-digit numbers, "12+34+...=" (13-37 tokens), answer the sum
    reward      `brief`: 1 when the completion ended within BRIEF_TOKENS tokens (verifiable from the text: one filler
                word per token), so groups have reward variance and the advantages are not all zero.

    python benchmarks/qwen3_shape.py            # builds runs/qwen3_shape (cached), prints the length distribution
"""

import json
import math
import os
import random
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

QWEN3_VOCAB = 151_936
SHAPE_DIR = "runs/qwen3_shape"  # relative to the folder it runs in (step_time.py runs its workers there too)
MEAN_LENGTH = 100
BRIEF_TOKENS = 64
VERSION = 1
# The scripts' flags for this task (step_time.py --shape qwen3; anything after -- still wins).
SHAPE_ARGS = ["--model", os.path.join(SHAPE_DIR, "model"), "--dataset", os.path.join(SHAPE_DIR, "train.jsonl"),
              "--prompt_template", "{prompt}", "--reward_funcs", "benchmarks.qwen3_shape:brief",
              "--rollout_engine", "hf", "--dtype", "float32", "--max_prompt_length", "64",
              "--max_completion_length", "256", "--temperature", "1.0", "--batch_size", "8", "--num_generations", "8",
              "--micro_batch_size", "4", "--learning_rate", "1e-6", "--beta", "0.04"]


def brief(prompts: list[str], completions: list[str], **_) -> list[float]:
    """1.0 when the completion stopped within BRIEF_TOKENS tokens (each filler token decodes to one 'w')."""
    return [float(c.count("w") < BRIEF_TOKENS) for c in completions]


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = ["<pad>", "<eos>", *"0123456789+="]
    vocab = {tok: i for i, tok in enumerate(base + [f"w{i}" for i in range(len(base), QWEN3_VOCAB)])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # prompts: one token per character
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left")


def build_model(tokenizer, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=QWEN3_VOCAB, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    model = Qwen3ForCausalLM(config)
    eos = tokenizer.eos_token_id
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0  # a constant dimension in every embedding ...
        for layer in model.model.layers:  # ... that no layer writes to: it reaches the head unchanged
            layer.self_attn.o_proj.weight[0] = 0
            layer.mlp.down_proj.weight[0] = 0
        model.lm_head.weight[:, 0] = 0  # read only by EOS's row
        ids = torch.randint(2, QWEN3_VOCAB, (4, 256), generator=torch.Generator().manual_seed(seed))
        hidden = model.model(input_ids=ids).last_hidden_state[..., 0].mean()  # the constant, after the final norm
        model.lm_head.weight[eos, 0] = math.log(QWEN3_VOCAB / (MEAN_LENGTH - 1)) / hidden  # P(EOS) ~ 1 / MEAN_LENGTH
    return model


def make_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        terms = [rng.randrange(10, 100) for _ in range(rng.randint(4, 12))]
        rows.append({"prompt": "+".join(map(str, terms)) + "=", "answer": str(sum(terms))})
    return rows


def prepare(path: str = SHAPE_DIR, seed: int = 0) -> str:
    """Build (or reuse) the model, tokenizer and prompts under `path`."""
    info_file = os.path.join(path, "shape.json")
    if os.path.exists(info_file):
        with open(info_file) as f:
            if json.load(f).get("version") == VERSION:
                return path
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed)
    model.save_pretrained(os.path.join(path, "model"))
    tokenizer.save_pretrained(os.path.join(path, "model"))
    for name, n in [("train", 2000), ("test", 100)]:
        with open(os.path.join(path, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in make_rows(n, seed + (name == "test")))
    with open(info_file, "w") as f:  # last: its presence means the folder is complete
        json.dump({"version": VERSION, "seed": seed, "num_parameters": sum(p.numel() for p in model.parameters())}, f)
    return path


def main():
    from transformers import AutoModelForCausalLM

    path = prepare()
    model = AutoModelForCausalLM.from_pretrained(os.path.join(path, "model"))
    tokenizer = build_tokenizer()
    ids = tokenizer(["12+34+56+78="] * 16, return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**ids, do_sample=True, top_k=0, max_new_tokens=256, pad_token_id=0)
    out = out[:, ids["input_ids"].shape[1]:]
    lengths = sorted(int((row != 0).sum()) for row in out)
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"{millions:.1f}M parameters; 16 sampled completion lengths (cap 256): {lengths}")


if __name__ == "__main__":
    main()
