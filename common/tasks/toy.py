"""The toy task: two-digit addition with a tiny Qwen3, fully offline, learnable on a laptop CPU.

`prepare_toy(path)` builds everything the training scripts need and writes it to disk, so the
scripts load it through the same `from_pretrained` / `load_dataset` code as a real model and data:

    path/model/          a ~300k-parameter Qwen3 (real transformers architecture) with a
                         character-level tokenizer, warm-started by a short supervised phase
                         to roughly 30-50% greedy accuracy, saved with `save_pretrained`
    path/train.jsonl     {"prompt": "12+34=", "answer": "46"}   (all pairs not held out)
    path/test.jsonl      held-out pairs

The supervised warm start matters: RL from a random policy would almost never see a reward. The
result is cached and reused (same seed -> same files), so every algorithm starts from the same
weights. `--preset toy_tir`, the multi-turn variant with a calculator tool, is
common/tasks/toy_tir.py.
"""

import contextlib
import fcntl
import json
import os
import random
import time
from collections.abc import Callable

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from common.tasks.rewards import register_reward, texts_of, toy_addition

TOY_DIR = "runs/toy"
CHARS = list("0123456789+=")
SPECIAL = ["<pad>", "<eos>"]
NUM_TEST = 500
# bumped when the model or data change, so an older runs/toy is rebuilt, not reused (2: head_dim 32)
TOY_VERSION = 2



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
    # no-grad passes over the whole batch: fewer, larger forwards (and shared prompts)
    logprob_batch_size=256,
    # a constant schedule, without warmup (the warmup_steps=10 once set here did nothing)
    learning_rate=5e-4,
    eval_steps=50,
    eval_num_prompts=500,
    # a checkpoint every 100 steps (under a minute): a stopped quick start can --resume_from it
    save_steps=100,
    report_to="none",
    # sdpo.py's re-prompt in the toy's vocabulary (digits, + and =), where TRL's English would be
    # unknown tokens: "12+34=" with the success "46" reads "12+34=46=12+34="
    reprompt_template="{prompt}{solution}{feedback}={prompt}",
    solution_template="{successful_previous_attempt}",
    feedback_template="{feedback_raw}",
)


# `--preset toy_tir`: the TIR toy, two model turns with the calculator in between.


PRESETS = {"toy": TOY_PRESET}  # common/tasks/data.py PRESET_MODULES

# TRL's conversational rows on the toy: a user turn renders as the text prompt it holds ("12+34="),
# so they train as the text rows do; an answer ends with EOS. The vocabulary is digits, + and =:
# a system turn (--system_prompt) is refused, not turned into unknown tokens.
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}"
    "{{ raise_exception('the toy has no system turn: its vocabulary is digits, + and =') }}"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] + eos_token }}"
    "{% else %}{{ m['content'] }}{% endif %}"
    "{% endfor %}"
)


def build_tokenizer(chars: list[str] = CHARS,
                    chat_template: str | None = CHAT_TEMPLATE):
    """The toy's character-level tokenizer (a transformers PreTrainedTokenizerFast)."""
    # transformers' classes here, not at the top: --preset toy's defaults are read before a bad
    # flag is refused, which needs no model code (benchmarks/refusal_latency.py)
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # and decode without spaces between them
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", padding_side="left"
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def add_chat_template(model_dir: str) -> None:
    """A toy built before it had a chat template (same weights, same TOY_VERSION) gets it as a file
    beside the tokenizer, which transformers reads (chat_template.jinja): no rebuild."""
    path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.exists(path) or not os.path.isdir(model_dir):
        return
    with open(f"{path}.{os.getpid()}.tmp", "w") as f:
        f.write(CHAT_TEMPLATE)
    os.replace(f"{path}.{os.getpid()}.tmp", path)  # whole, or not at all


def build_model(tokenizer, seed: int):
    """A Qwen3ForCausalLM of the toy's size, its weights drawn from `seed`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

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


@register_reward("toy_closeness")
def toy_closeness(prompts: list[str], completions: list, answer: list[str],
                  **_) -> list[float]:
    """A dense toy reward: 1.0 for the exact sum, 0.5 / (1 + |n - sum|) for another number n, 0.0
    for anything else. Numbers at different distances from the sum get different rewards, so a group
    of distinct completions rarely has equal rewards (the tests use it where their meaning needs a
    nonzero gradient, whatever toy this machine built)."""
    completions = texts_of(completions)  # text, or TRL's conversational form
    return [1.0 if c.strip() == a.strip()
            else 0.5 / (1 + abs(int(c.strip()) - int(a))) if c.strip().isdigit()
            else 0.0
            for c, a in zip(completions, answer)]


def default_seed() -> int:
    """The toy's seed: 0, or TOY_SEED=N. CI runs the fast tests on a second toy (TOY_SEED=1) as
    well, so that no test passes only with the floats of one build."""
    return int(os.environ.get("TOY_SEED", "0"))


@torch.no_grad()
def greedy_completions(model, tokenizer, prompts: list[str], max_new_tokens: int,
                       batch_size: int = 500) -> list[str]:
    """Greedy completions of `prompts`, decoded without EOS (one engine-free model turn: no tool
    runs)."""
    model.eval()
    texts = []
    for i in range(0, len(prompts), batch_size):
        enc = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True)
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :],
                                        skip_special_tokens=True)
    return texts


def greedy_accuracy(model, tokenizer, rows: list[dict]) -> float:
    """Fraction of rows whose greedy completion is the exact sum (used to report the warm start)."""
    texts = greedy_completions(model, tokenizer, [r["prompt"] for r in rows], max_new_tokens=4)
    return sum(toy_addition([], texts, [r["answer"] for r in rows])) / len(rows)


def warm_start(model, tokenizer, examples: list[list[tuple[str, bool]]], seed: int,
               done: Callable[[], bool], max_steps: int = 2000, batch_size: int = 64,
               lr: float = 5e-3, check_every: int = 10) -> int:
    """Supervised next-token training on `examples`, each a list of (text, trained) segments whose
    concatenation is one sequence; the loss covers the tokens of trained segments only (the answer
    and EOS, not the prompt nor tool output). Stops when `done()` (checked every `check_every`
    steps) or after `max_steps`. Addition is learned abruptly (the carry), so a fixed step count
    lands anywhere between 10% and 90% depending on float rounding; stopping at a measured accuracy
    makes the warm start the same kind of policy on every machine."""
    texts = [text for ex in examples for text, _ in ex]
    ids = iter(tokenizer(texts, add_special_tokens=False)["input_ids"])
    lengths = [[len(next(ids)) for _ in ex] for ex in examples]  # tokens per segment
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for step in range(1, max_steps + 1):
        model.train()
        idx = torch.randint(len(examples), (batch_size,), generator=gen).tolist()
        enc = tokenizer(["".join(text for text, _ in examples[i]) for i in idx],
                        return_tensors="pt", padding=True)
        labels = enc["input_ids"].clone()
        labels[enc["attention_mask"] == 0] = -100
        for row, i in enumerate(idx):  # left-padded: the first segment sits right after the padding
            start = int((enc["attention_mask"][row] == 0).sum())
            for (_, trained), n in zip(examples[i], lengths[i]):
                if not trained:
                    labels[row, start : start + n] = -100
                start += n
        position_ids = (enc["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        loss = model(**enc, position_ids=position_ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % check_every == 0 and done():
            break
    model.eval()
    return step


def cached_info(info_file: str, expected: dict) -> dict | None:
    """The info of a complete earlier build with the same `expected` settings (version, seed, ...),
    else None."""
    if not os.path.exists(info_file):
        return None
    with open(info_file) as f:
        info = json.load(f)
    return info if all(info.get(k) == v for k, v in expected.items()) else None


def write_splits(path: str, train: list[dict], test: list[dict]) -> None:
    os.makedirs(path, exist_ok=True)
    for name, rows in [("train", train), ("test", test)]:
        with open(os.path.join(path, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def save_toy(path: str, model, tokenizer, info: dict) -> dict:
    """Save the model and tokenizer, then `info` (written last: its presence means the build is
    complete)."""
    info = {**info, "num_parameters": sum(p.numel() for p in model.parameters()),
            **{k: os.path.join(path, k if k == "model" else f"{k}.jsonl")
               for k in ("model", "train", "test")}}
    model.save_pretrained(info["model"])
    tokenizer.save_pretrained(info["model"])
    with open(os.path.join(path, "toy.json"), "w") as f:
        json.dump(info, f, indent=2)
    return info


@contextlib.contextmanager
def one_builder(path: str):
    """Build under `path`.lock (a second process waits, then finds the first one's build), on one
    thread: a model this small gains nothing from more, and on busy cores more threads made it ten
    times slower."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(os.path.abspath(path) + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


def announce(path: str, what: str) -> None:
    print(f"toy: building {path} once ({what}; under a minute on an idle core, later runs reuse "
          f"it)", flush=True)


def prepare_toy(path: str, seed: int | None = None, target_accuracy: float = 0.35) -> dict:
    """Build (or reuse) the toy model and data under `path`; returns the paths and warm-start
    accuracy. `seed`: ``default_seed()`` when None (TOY_SEED); a toy built from another seed is
    rebuilt, not reused."""
    seed = default_seed() if seed is None else seed
    settings = {"version": TOY_VERSION, "seed": seed, "target_accuracy": target_accuracy}
    info = cached_info(os.path.join(path, "toy.json"), settings)
    if info is not None:
        add_chat_template(os.path.join(path, "model"))
        return info
    with one_builder(path):
        info = cached_info(os.path.join(path, "toy.json"), settings)
        if info is not None:
            return info  # another process built it while this one waited
        announce(path, "a 300k-parameter Qwen3, warm-started on two-digit addition")
        return build_toy(path, seed, settings, target_accuracy)


def build_toy(path: str, seed: int, settings: dict, target_accuracy: float) -> dict:
    train, test = make_splits(seed)
    write_splits(path, train, test)
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed)
    start = time.time()
    examples = [[(r["prompt"], False), (r["answer"] + tokenizer.eos_token, True)] for r in train]
    steps = warm_start(model, tokenizer, examples, seed,
                       done=lambda: (greedy_accuracy(model, tokenizer, train[:NUM_TEST])
                                     >= target_accuracy))
    return save_toy(path, model, tokenizer, {
        **settings,
        "warm_start_steps": steps,
        "warm_start_seconds": round(time.time() - start, 1),
        "warm_start_test_accuracy": greedy_accuracy(model, tokenizer, test),
    })


def prepare_preset(preset: str | None) -> None:
    """Build what --preset toy reads from disk (the toy's model and data), once
    (common/tasks/data.py PRESET_MODULES)."""
    if preset == "toy":
        prepare_toy(TOY_DIR)
        # for the run too: a model this small gains nothing from more, busy cores lose much
        torch.set_num_threads(1)
