"""The TIR toy (`--preset toy_tir`): the toy task's multi-turn variant, under runs/toy_tir.

`prepare_toy_tir(path)` builds sums of two 3- to 5-digit numbers, too long for the tiny model to add
by itself, and a calculator tool (`--tool toy`, common/engines/multiturn.py's) that it calls by
writing the sum in brackets. One trajectory:

    12345+54321=[12345+54321]=66666\n66666<eos>
    '- prompt -''-- model --'' tool '' model -'

The warm start answers most prompts directly and calls the tool on a minority, so that sampling
explores both and greedy decoding answers directly: RL with --max_turns 2 learns to call.
"""

import os
import random
import time

import torch

from common.engines.multiturn import calculator_output
from common.engines.sandbox import ToolResult
from common.tasks.rewards import register_reward, texts_of
from common.tasks.toy import (
    CHARS,
    NUM_TEST,
    announce,
    build_model,
    build_tokenizer,
    cached_info,
    greedy_completions,
    one_builder,
    save_toy,
    warm_start,
    write_splits,
)

TOY_TIR_DIR = "runs/toy_tir"
# the toy's, a call's brackets, the line break after tool output, E for errors
TIR_CHARS = CHARS + list("[]\nE")
# digits of each operand (4 to 6: the warm start takes about twice as long to learn to copy)
TIR_DIGITS = (3, 5)
TIR_NUM_TRAIN = 20_000
# examples of the warm start's second phase that call the calculator; the rest answer directly
TIR_TOOL_FRACTION = 0.1
TOY_TIR_VERSION = 1  # bumped when the TIR toy's model or data change


# `--preset toy_tir`: defaults for a CPU run of a few minutes (any
# flag given on the command line wins).
TOY_TIR_PRESET = dict(
    model=os.path.join(TOY_TIR_DIR, "model"),
    dataset=os.path.join(TOY_TIR_DIR, "train.jsonl"),
    eval_dataset=os.path.join(TOY_TIR_DIR, "test.jsonl"),
    prompt_template="{prompt}",
    reward_funcs="toy_tir_addition",
    rollout_engine="hf",
    dtype="float32",
    max_turns=2,
    tool="toy",
    max_prompt_length=12,
    max_completion_length=28,  # [5+1+5 characters] (13) + =sum\n (8) + sum<eos> (7)
    temperature=1.0,
    total_steps=60,
    batch_size=128,
    num_generations=8,
    micro_batch_size=64,
    logprob_batch_size=128,
    learning_rate=1e-3,
    eval_steps=20,
    eval_num_prompts=200,
    save_steps=0,
    report_to="none",
)


PRESETS = {"toy_tir": TOY_TIR_PRESET}  # common/tasks/data.py PRESET_MODULES


@register_reward("toy_tir_addition")
def toy_tir_addition(prompts: list[str], completions: list, answer: list[str],
                     **_) -> list[float]:
    """1.0 when the trajectory's last line (what follows the last tool output, or the whole
    completion when no tool ran) is the exact sum, else 0.0: a call, or its output, is not an
    answer."""
    completions = texts_of(completions)  # text, or TRL's conversational form
    return [float(c.rsplit("\n", 1)[-1].strip() == a.strip()) for c, a in zip(completions, answer)]


def make_tir_splits(seed: int) -> tuple[list[dict], list[dict]]:
    """TIR_NUM_TRAIN + NUM_TEST distinct pairs a+b, each operand of TIR_DIGITS digits (the count
    drawn uniformly)."""
    rng = random.Random(seed)

    def number() -> int:
        digits = rng.randint(*TIR_DIGITS)
        return rng.randrange(10 ** (digits - 1), 10**digits)

    pairs = {}  # a dict keeps the order of drawing
    while len(pairs) < TIR_NUM_TRAIN + NUM_TEST:
        pairs.setdefault((number(), number()), None)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
    return rows[NUM_TEST:], rows[:NUM_TEST]


def tir_example(row: dict, call: bool, eos: str) -> list[tuple[str, bool]]:
    """A warm-start trajectory as (text, trained) segments: the direct answer, or the call, the
    tool's output (not trained: the sandbox writes it) and the answer copied from it."""
    if not call:
        return [(row["prompt"], False), (row["answer"] + eos, True)]
    output = calculator_output(ToolResult(output=row["answer"] + "\n", error=None, seconds=0.0))
    call = "[" + row["prompt"].removesuffix("=") + "]"
    return [(row["prompt"], False), (call, True), (output, False), (row["answer"] + eos, True)]


@torch.no_grad()
def tir_skills(model, tokenizer, rows: list[dict]) -> dict[str, float]:
    """The TIR toy's policy, measured without the sandbox: the mean probability of calling (first
    token "["), the greedy policy's call rate and direct-answer accuracy, and, with the call forced,
    how often the call and then the answer copied from the tool's output are exact (greedy)."""
    enc = tokenizer([r["prompt"] for r in rows], return_tensors="pt", padding=True)
    position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    # (N, V) left-padded: the prompts' last token
    first_logits = model(**enc, position_ids=position_ids).logits[:, -1]
    call_prob = first_logits.softmax(-1)[:, tokenizer.convert_tokens_to_ids("[")].mean().item()
    first = greedy_completions(model, tokenizer, [r["prompt"] for r in rows], max_new_tokens=8)
    calls = greedy_completions(model, tokenizer, [r["prompt"] + "[" for r in rows],
                               max_new_tokens=14)
    # prompt, call, output
    after_tool = ["".join(text for text, _ in tir_example(r, True, "")[:3]) for r in rows]
    answers = greedy_completions(model, tokenizer, after_tool, max_new_tokens=8)
    n = len(rows)
    return {"call_prob": call_prob, "greedy_call_frac": sum(t.startswith("[") for t in first) / n,
            "direct_accuracy": sum(t == r["answer"] for t, r in zip(first, rows)) / n,
            "call_accuracy": sum(t.startswith(r["prompt"][:-1] + "]")
                                 for t, r in zip(calls, rows)) / n,
            "copy_accuracy": sum(t == r["answer"] for t, r in zip(answers, rows)) / n}


def prepare_toy_tir(path: str, seed: int = 0, target_accuracy: float = 0.6, mix_steps: int = 150,
                    mix_lr: float = 1e-3) -> dict:
    """Build (or reuse) the TIR toy under `path`. Two supervised phases: the skill (every example
    calls the tool, until the forced call and the answer copied from its output are each exact on
    `target_accuracy` of training prompts), then the habit (`mix_steps` at `mix_lr` on a mix where
    TIR_TOOL_FRACTION call and the rest answer directly): sampling then calls now and then, and
    greedy decoding answers directly, wrongly. The tool pays; RL with --max_turns 2 has to find that
    out. In a single mixed phase one example in ten would teach the copying."""
    settings = {"version": TOY_TIR_VERSION, "seed": seed, "target_accuracy": target_accuracy,
                "mix_steps": mix_steps, "mix_lr": mix_lr}
    info = cached_info(os.path.join(path, "toy.json"), settings)
    if info is not None:
        return info
    with one_builder(path):
        info = cached_info(os.path.join(path, "toy.json"), settings)
        if info is not None:
            return info  # another process built it while this one waited
        announce(path, "the TIR toy: a small Qwen3 warm-started to call a calculator")
        return build_toy_tir(path, seed, settings, target_accuracy, mix_steps, mix_lr)


def build_toy_tir(path: str, seed: int, settings: dict, target_accuracy: float, mix_steps: int,
                  mix_lr: float) -> dict:
    train, test = make_tir_splits(seed)
    write_splits(path, train, test)
    tokenizer = build_tokenizer(TIR_CHARS, chat_template=None)  # text prompts only
    model = build_model(tokenizer, seed)
    start = time.time()

    def skilled() -> bool:
        skills = tir_skills(model, tokenizer, train[:200])  # enough to see a skill appear
        return min(skills["call_accuracy"], skills["copy_accuracy"]) >= target_accuracy

    eos = tokenizer.eos_token
    steps = warm_start(model, tokenizer, [tir_example(r, True, eos) for r in train], seed, skilled,
                       max_steps=2000, check_every=50)
    rng = random.Random(seed)
    mix = [tir_example(r, rng.random() < TIR_TOOL_FRACTION, eos) for r in train]
    warm_start(model, tokenizer, mix, seed + 1, done=lambda: False, max_steps=mix_steps, lr=mix_lr)
    return save_toy(path, model, tokenizer, {
        **settings,
        "warm_start_steps": steps + mix_steps,
        "warm_start_seconds": round(time.time() - start, 1),
        **{f"warm_start_test_{k}": round(v, 4)
           for k, v in tir_skills(model, tokenizer, test).items()},
    })


def prepare_preset(preset: str | None) -> None:
    """Build what --preset toy_tir reads from disk (the TIR toy's model and data), once."""
    if preset == "toy_tir":
        prepare_toy_tir(TOY_TIR_DIR)
