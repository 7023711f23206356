"""The TIR toy (`--preset toy_tir`): the calculator tool through the real sandbox, its reward, its data, and a short
grpo.py run with --max_turns 2 (slow: builds runs/toy_tir once per session)."""

import os

import pytest
from conftest import read_metrics, run_script

import grpo
from common.engines.multiturn import TOOLS, sample_completions
from common.engines.sandbox import ToolResult
from common.tasks.toy import CHARS, NUM_TEST, SPECIAL, build_tokenizer
from common.tasks.toy_tir import (
    TIR_CHARS,
    TIR_DIGITS,
    TIR_NUM_TRAIN,
    TOY_TIR_DIR,
    calculator_output,
    make_tir_splits,
    prepare_toy_tir,
    toy_tir_addition,
)

TOKENIZER = build_tokenizer(TIR_CHARS)


class Script:
    """A policy that writes turns[prompt][k] as its k-th model turn (EOS after the last one), stopping as the engines
    do at the first stop string; k counts the calls closed so far. Each token's log-prob is -0.5."""

    def __init__(self, turns: dict[str, list[str]]):
        self.turns = turns

    def generate(self, model, prompt_ids, seeds, *, max_tokens, temperature, top_p, stop=None):
        budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompt_ids)
        completions = [self.complete(TOKENIZER.decode(ids), budget, stop or [])
                       for ids, budget in zip(prompt_ids, budgets)]
        return completions, [[-0.5] * len(c) for c in completions]

    def complete(self, context: str, budget: int, stop: list[str]) -> list[int]:
        prompt = next(p for p in self.turns if context.startswith(p))
        turns = self.turns[prompt]
        k = context.count("]")
        text = turns[k]
        ends = [text.index(s) + len(s) for s in stop if s in text]
        text = text[: min(ends)] if ends else text
        ids = TOKENIZER(text, add_special_tokens=False)["input_ids"]
        if not ends and k == len(turns) - 1:
            ids.append(TOKENIZER.eos_token_id)
        return ids[:budget]


def rollout(turns: dict[str, list[str]], max_turns: int = 2, max_tokens: int = 32):
    prompts = list(turns)
    ids = [TOKENIZER(p, add_special_tokens=False)["input_ids"] for p in prompts]
    out = sample_completions(Script(turns), None, TOKENIZER, ids, list(range(len(prompts))), max_tokens=max_tokens,
                             temperature=1.0, top_p=1.0, max_turns=max_turns, tool="toy")
    return out, TOKENIZER.batch_decode(out.completion_ids, skip_special_tokens=True)


@pytest.mark.sandbox
def test_a_call_runs_in_the_sandbox_and_its_output_is_masked():
    out, texts = rollout({"123456+654321=": ["[123456+654321]", "777777"],
                          "4321+98765=": ["103086"],  # answers directly: no tool turn
                          "1234+5678=": ["[1234+]", "6912"]})  # a broken call: the tool says E
    assert texts == ["[123456+654321]=777777\n777777", "103086", "[1234+]=E\n6912"]
    assert out.tool_calls == [1, 0, 1] and out.tool_errors == [0, 0, 1]
    assert out.finish == ["eos", "eos", "eos"]
    call, tool = len("[123456+654321]"), len("=777777\n")
    assert out.action_mask[0] == [1] * call + [0] * tool + [1] * 7  # 777777 and EOS
    assert out.sampler_logp[0][call : call + tool] == [0.0] * tool  # tool tokens: context, not actions
    assert out.action_mask[1] == [1] * 7
    assert toy_tir_addition([], texts, ["777777", "103086", "6912"]) == [1.0, 1.0, 1.0]


def test_one_turn_generates_calls_but_never_runs_them():
    out, texts = rollout({"123456+654321=": ["[123456+654321]", "777777"]}, max_turns=1)
    assert texts == ["[123456+654321]"] and out.tool_calls == [0] and out.finish == ["length"]
    out, texts = rollout({"123456+654321=": ["[123456+654321]", "777777"]}, max_turns=2, max_tokens=15)
    assert out.tool_calls == [0] and out.finish == ["length"]  # no budget left for the tool turn


@pytest.mark.sandbox
def test_a_second_call_is_not_run_and_is_not_an_answer():
    out, texts = rollout({"1000+2000=": ["[1000+2000]", "[3000+1]"]})
    assert texts == ["[1000+2000]=3000\n[3000+1]"] and out.tool_calls == [1] and out.finish == ["max_turns"]
    assert toy_tir_addition([], texts, ["3000"]) == [0.0]


@pytest.mark.parametrize("result, text", [
    (ToolResult("777777\n", None, 0.1), "=777777\n"),
    (ToolResult("  File ...\nSyntaxError: invalid syntax\n", "exit 1", 0.1), "=E\n"),
    (ToolResult("1e+20\n", None, 0.1), "=E\n"),  # not a whole number
    (ToolResult("True\n", None, 0.1), "=E\n"),
    (ToolResult("12\n", "timeout", 5.0), "=E\n"),
    (ToolResult("", None, 0.1), "=E\n"),
])
def test_calculator_output_is_a_number_or_E_and_always_encodable(result, text):
    assert calculator_output(result) == text
    ids = TOKENIZER(text, add_special_tokens=False)["input_ids"]
    assert TOKENIZER.decode(ids) == text and TOKENIZER.pad_token_id not in ids  # unknown characters become <pad>


def test_the_tool_is_registered_and_its_program_prints_the_call():
    tool = TOOLS["toy"]
    assert (tool.code_start, tool.code_end, tool.is_final) == ("[", "]", None)
    assert tool.program("1+2") == "print(1+2)"


@pytest.mark.parametrize("completion, reward", [
    ("777777", 1.0),  # a direct answer
    (" 777777 ", 1.0),
    ("[123456+654321]=777777\n777777", 1.0),  # the answer copied from the tool's output
    ("[123456+654321]=777777\n", 0.0),  # stopped after the tool's output
    ("[123456+654321]=777777\n77777", 0.0),
    ("[123456+654321]=E\n777777", 1.0),  # graded on the answer, however it was found
    ("[123456+654321]", 0.0),  # a call is not an answer
    ("=777777", 0.0),
    ("777777\n1", 0.0),
    ("", 0.0),
])
def test_reward_grades_the_last_line(completion, reward):
    assert toy_tir_addition(["123456+654321="], [completion], ["777777"]) == [reward]


def test_tir_splits_are_disjoint_big_sums_in_the_toy_vocabulary():
    train, test = make_tir_splits(seed=0)
    assert (len(train), len(test)) == (TIR_NUM_TRAIN, NUM_TEST)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert make_tir_splits(seed=0) == (train, test)
    for row in train[:1000] + test:
        a, b = map(int, row["prompt"][:-1].split("+"))
        low, high = 10 ** (TIR_DIGITS[0] - 1), 10 ** TIR_DIGITS[1]
        assert low <= a < high and low <= b < high and int(row["answer"]) == a + b
        assert set(row["prompt"] + row["answer"]) <= set(TIR_CHARS)

def test_the_tir_vocabulary_extends_the_toys():
    toy = build_tokenizer().get_vocab()
    assert toy == {t: i for i, t in enumerate(SPECIAL + CHARS)}  # the toy's tokenizer is untouched
    assert {t: i for t, i in TOKENIZER.get_vocab().items() if t in toy} == toy
    assert set(TOKENIZER.get_vocab()) - set(toy) == {"[", "]", "\n", "E"}


@pytest.fixture(scope="session")
def toy_tir_workdir(tmp_path_factory):
    """A working directory holding runs/toy_tir (the toy_tir preset finds it there)."""
    workdir = tmp_path_factory.mktemp("work_tir")
    prepare_toy_tir(str(workdir / TOY_TIR_DIR))
    return workdir


@pytest.mark.slow
def test_warm_start_can_use_the_tool_but_rarely_does(toy_tir_workdir):
    info = prepare_toy_tir(str(toy_tir_workdir / TOY_TIR_DIR))  # cached: the session's build
    assert info["warm_start_test_greedy_call_frac"] < 0.2  # greedy decoding answers directly ...
    assert info["warm_start_test_direct_accuracy"] < 0.1  # ... and wrongly
    assert 0.05 < info["warm_start_test_call_prob"] < 0.5  # sampling calls now and then
    assert min(info["warm_start_test_call_accuracy"], info["warm_start_test_copy_accuracy"]) > 0.6  # calls pay


@pytest.mark.slow
@pytest.mark.sandbox
def test_grpo_runs_on_the_tir_toy_with_tool_calls(toy_tir_workdir, monkeypatch):
    monkeypatch.chdir(toy_tir_workdir)
    run_dir = run_script(grpo, ["--preset", "toy_tir", "--batch_size", "32", "--num_generations", "4",
                                "--micro_batch_size", "32", "--total_steps", "2", "--eval_steps", "2",
                                "--eval_num_prompts", "16", "--run_name", "tir"])
    rows = read_metrics(run_dir)
    train = [r for r in rows if "tool/calls_mean" in r]
    assert len(train) == 2 and all(0 <= r["tool/calls_mean"] <= 1 for r in train)
    assert any(r["tool/calls_mean"] > 0 for r in train)  # sampling calls the tool now and then
    assert all(0 < r["tool/masked_token_frac"] < 1 for r in train if r["tool/calls_mean"] > 0)
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2]
    assert os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
