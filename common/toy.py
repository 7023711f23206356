"""The toy task: two-digit addition with a tiny Qwen3, fully offline, learnable on a laptop CPU.

`prepare_toy(path)` builds everything the training scripts need and writes it to disk, so the
scripts load it through the same `from_pretrained` / `load_dataset` code as a real model and data:

    path/model/          a ~300k-parameter Qwen3 (real transformers architecture) with a
                         character-level tokenizer, warm-started by a short supervised phase
                         to roughly 30-50% greedy accuracy, saved with `save_pretrained`
    path/train.jsonl     {"prompt": "12+34=", "answer": "46"}   (all pairs not held out)
    path/test.jsonl      held-out pairs

The supervised warm start matters: RL from a random policy would almost never see a reward.
The result is cached and reused (same seed -> same files), so every algorithm starts from the
same weights.
"""

import json
import os
import random
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from common.rewards import register_reward

TOY_DIR = "runs/toy"
CHARS = list("0123456789+=")
SPECIAL = ["<pad>", "<eos>"]
NUM_TEST = 500
TOY_VERSION = 2  # bumped when the model or data change, so an older runs/toy is rebuilt, not reused (2: head_dim 32)


# `--preset toy`: defaults for a CPU run of a few minutes (any flag given on the command line wins).
TOY_PRESET = dict(
    model=os.path.join(TOY_DIR, "model"),
    dataset=os.path.join(TOY_DIR, "train.jsonl"),
    eval_dataset=os.path.join(TOY_DIR, "test.jsonl"),
    prompt_template="{prompt}",
    reward_funcs="toy_addition",
    rollout_engine="hf",
    dtype="float32",
    max_prompt_length=8,
    max_completion_length=6,
    temperature=1.0,
    total_steps=500,
    batch_size=256,
    num_generations=8,
    micro_batch_size=64,
    logprob_batch_size=256,  # no-grad passes over the whole batch: fewer, larger forwards (and shared prompts)
    learning_rate=5e-4,  # a constant schedule, without warmup (the warmup_steps=10 once set here did nothing)
    eval_steps=50,
    eval_num_prompts=500,
    save_steps=0,
    report_to="none",
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # and decode without spaces between them
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left"
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention has no kernel for head_dim 16
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    return Qwen3ForCausalLM(config)


def make_splits(seed: int) -> tuple[list[dict], list[dict]]:
    """All 10,000 ordered pairs a+b with 0 <= a, b < 100; NUM_TEST of them held out."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(100) for b in range(100)]
    random.Random(seed).shuffle(rows)
    return rows[NUM_TEST:], rows[:NUM_TEST]


@register_reward("toy_addition")
def toy_addition(prompts: list[str], completions: list[str], answer: list[str], **_) -> list[float]:
    """1.0 for the exact sum (the completion text before EOS, spaces ignored), else 0.0."""
    return [float(c.strip() == a.strip()) for c, a in zip(completions, answer)]


@torch.no_grad()
def greedy_accuracy(model, tokenizer, rows: list[dict], batch_size: int = 500) -> float:
    """Fraction of rows whose greedy completion is the exact sum (used to report the warm start)."""
    model.eval()
    correct = 0
    for i in range(0, len(rows), batch_size):
        chunk = rows[i : i + batch_size]
        enc = tokenizer([r["prompt"] for r in chunk], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(toy_addition([], texts, [r["answer"] for r in chunk]))
    return correct / len(rows)


def warm_start(model, tokenizer, rows: list[dict], valid: list[dict], seed: int, target_accuracy: float,
               max_steps: int = 2000, batch_size: int = 64, lr: float = 5e-3, check_every: int = 10) -> int:
    """Supervised next-token training on `prompt + answer + EOS` (loss on the answer tokens only) until
    greedy accuracy on `valid` reaches `target_accuracy`. Addition is learned abruptly (the carry),
    so a fixed step count lands anywhere between 10% and 90% depending on float rounding; stopping
    at a measured accuracy makes the warm start the same kind of policy on every machine."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(1, max_steps + 1):
        model.train()
        idx = torch.randint(len(rows), (batch_size,), generator=gen).tolist()
        prompts = [rows[i]["prompt"] for i in idx]
        full = [rows[i]["prompt"] + rows[i]["answer"] + tokenizer.eos_token for i in idx]
        enc = tokenizer(full, return_tensors="pt", padding=True)
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        for row, p in enumerate(prompts):  # left-padded: the prompt sits right after the padding
            start = int((enc["attention_mask"][row] == 0).sum())
            labels[row, : start + len(p)] = -100
        position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        loss = model(**enc, position_ids=position_ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % check_every == 0 and greedy_accuracy(model, tokenizer, valid) >= target_accuracy:
            break
    model.eval()
    return step


def prepare_toy(path: str, seed: int = 0, target_accuracy: float = 0.35) -> dict:
    """Build (or reuse) the toy model and data under `path`; returns the paths and warm-start accuracy."""
    info_file = os.path.join(path, "toy.json")
    if os.path.exists(info_file):
        with open(info_file) as f:
            info = json.load(f)
        if (info.get("version"), info["seed"], info["target_accuracy"]) == (TOY_VERSION, seed, target_accuracy):
            return info
    os.makedirs(path, exist_ok=True)
    train, test = make_splits(seed)
    for name, rows in [("train", train), ("test", test)]:
        with open(os.path.join(path, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed)
    start = time.time()
    steps = warm_start(model, tokenizer, train, train[:NUM_TEST], seed, target_accuracy)
    info = {
        "version": TOY_VERSION,
        "seed": seed,
        "target_accuracy": target_accuracy,
        "warm_start_steps": steps,
        "warm_start_seconds": round(time.time() - start, 1),
        "warm_start_test_accuracy": greedy_accuracy(model, tokenizer, test),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "model": os.path.join(path, "model"),
        "train": os.path.join(path, "train.jsonl"),
        "test": os.path.join(path, "test.jsonl"),
    }
    model.save_pretrained(info["model"])
    tokenizer.save_pretrained(info["model"])
    with open(info_file, "w") as f:  # written last: its presence means the toy is complete
        json.dump(info, f, indent=2)
    return info


def prepare_preset(preset: str | None) -> None:
    """Build what a --preset reads from disk (the toy's model and data), once; other presets read nothing."""
    if preset == "toy":
        prepare_toy(TOY_DIR)
