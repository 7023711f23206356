"""common/engines/multiturn.py: multi-turn, tool-integrated rollouts, and the engines' stop strings and per-row budgets.

A scripted engine checks the loop's bookkeeping exactly (turns, budgets, masks, seeds, engine calls); a tiny random
Qwen3 whose vocabulary holds code fences, some of them inside longer tokens ("\\n```\\n"), checks the HF engine's
rollouts against the trainer's log-probs, and (marked `vllm`, in a process of its own: one vLLM engine per process)
the vLLM engine's.
"""

import datetime
import json
import os
import re
import subprocess
import sys
from collections import namedtuple

import pytest
import tokenizers
import torch
import transformers
from accelerate import Accelerator
from conftest import subprocess_env

from common.engines import multiturn
from common.engines.multiturn import (
    FINAL_ANSWER_PREAMBLE,
    TIR_PROMPT_TEMPLATE,
    find_code,
    multi_turn_generate,
    simpletir_is_final,
    simpletir_output,
    turn_seed,
)
from common.engines.rollout import HFEngine
from common.logprobs import completion_logprobs
from common.sampling import pad_rows

ToolResult = namedtuple("ToolResult", "output error seconds")  # as common.engines.sandbox.ToolResult
FENCES = ["``", "```", "`\n", "```py\n", "\n```", "\n```\n"]  # tokens in which a fence ends inside, or spans two


def char_tokenizer(chars: str, multi: list[str] = ()) -> transformers.PreTrainedTokenizerFast:
    """One token per character when encoding (tool outputs); the `multi` tokens exist only for a model to sample."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *dict.fromkeys(chars), *multi])}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>",
                                                pad_token="<pad>")


def digit_sum(code: str) -> ToolResult:
    """A stand-in for common.engines.sandbox.run_python: prints the sum of the code's digits; code without any fails."""
    digits = [int(c) for c in code if c.isdigit()]
    return ToolResult(str(sum(digits)), None, 0.25) if digits else ToolResult("error", "exit 1", 0.25)


def output_block(result) -> str:
    return f"\n```output\n{result.output}\n```\n"


# ---------------------------------------------------------------- pure helpers

@pytest.mark.parametrize("text, code", [
    ("a\n```py\n1+2\n```", "1+2\n"),
    ("```\n1+2\n```\nmore ```py\n3\n```", "1+2\n"),  # the first block
    ("```py\n1+2\n", None),  # not closed
    ("x ```py", None),  # the opening fence's line is not over: its info string may go on
    ("x ```py```", None),  # a fence on the opening line does not close the block
    ("no code", None),
])
def test_find_code_reads_fenced_blocks(text, code):
    assert find_code(text, "```", "```") == code


def test_find_code_with_other_markers():
    assert find_code("a <code>1+2</code> b", "<code>", "</code>") == "1+2"
    assert find_code("a </code> <code>1+2", "<code>", "</code>") is None
    assert find_code("```python\n1\n```", "```python\n", "```") == "1\n"


def test_turn_seeds():
    assert turn_seed(123, 0, 0) == 123  # the first call samples as a single-turn rollout does
    seeds = {turn_seed(s, t, k) for s in (1, 2) for t in range(4) for k in range(4)}
    assert len(seeds) == 32 and all(0 <= s < 2**63 - 1 for s in seeds)


def test_simpletir_tool_turn():
    assert simpletir_output(ToolResult("3\n", None, 0.1)) == "\nCode execution result: 3\n\n"
    trace = "Traceback (most recent call last):\n  File ...\nNameError: name 'x' is not defined\n"
    assert simpletir_output(ToolResult(trace, "exit 1", 0.1)) == \
        "\nCode execution result: NameError: name 'x' is not defined\n"
    assert simpletir_output(ToolResult("", None, 0.1)) == ""
    long = simpletir_output(ToolResult("a" * 300 + "b" * 300, None, 0.1))
    assert long.startswith("\nCode execution result: " + "a" * 256 + "\n...") and long.endswith("b" * 256 + "\n")
    assert simpletir_is_final(ToolResult("\\boxed{3}\n", None, 0.1))
    assert not simpletir_is_final(ToolResult("3\n", None, 0.1))


def test_prompt_template_puts_the_question_last():
    assert TIR_PROMPT_TEMPLATE.count("{prompt}") == 1 and TIR_PROMPT_TEMPLATE.endswith("User Question:\n{prompt}")
    assert "```py\nanswer = 5 + 3 + 1294.678\nfinal_answer(answer)\n```" in TIR_PROMPT_TEMPLATE


# ---------------------------------------------------------------- the loop, with a scripted engine

SCRIPT_TOKENIZER = char_tokenizer("".join(chr(c) for c in range(32, 127)) + "\n", FENCES)


class ScriptedEngine:
    """A policy that writes a script: scripts[prompt] are its model turns, the k-th written after the k-th tool turn
    (the matches of `tool_turn`), EOS after the last. Tokens are the longest vocabulary entries that fit, so fences
    arrive inside longer tokens. Keeps the engines' contract: a call stops after the token that completes a stop
    string, at the row's budget, or after EOS. Each model token's log-prob is -0.5."""

    def __init__(self, scripts: dict[str, list[str]], tool_turn: str = r"\[[^\]]*\]"):
        self.scripts, self.tool_turn, self.calls = scripts, tool_turn, []
        self.vocab = SCRIPT_TOKENIZER.get_vocab()

    def generate(self, model, prompt_ids, seeds, *, max_tokens, temperature, top_p, stop=None):
        self.calls.append(list(zip(seeds, max_tokens)))
        completions = [self.complete(p, budget, stop or []) for p, budget in zip(prompt_ids, max_tokens)]
        return completions, [[-0.5] * len(c) for c in completions]

    def complete(self, prompt_ids, budget, stop):
        context = SCRIPT_TOKENIZER.decode(prompt_ids)
        prompt = next(p for p in self.scripts if context.startswith(p))
        *_, written = turns = re.split(self.tool_turn, context[len(prompt):])  # written: this turn's text so far
        turn = len(turns) - 1
        script = self.scripts[prompt][turn]
        assert script.startswith(written), (script, written)
        todo, out, text = script[len(written):], [], ""
        while todo and len(out) < budget and not any(s in text for s in stop):
            piece = max((t for t in self.vocab if todo.startswith(t)), key=len)
            out.append(self.vocab[piece])
            todo, text = todo[len(piece):], text + piece
        last_turn = turn == len(self.scripts[prompt]) - 1
        if not todo and last_turn and len(out) < budget and not any(s in text for s in stop):
            out.append(SCRIPT_TOKENIZER.eos_token_id)
        return out


def bracket(result) -> str:
    return f"[{result.output}]"


def scripted(scripts, prompts, tool_turn=r"\[[^\]]*\]", run_tool=digit_sum, **kw):
    engine, ran, first = ScriptedEngine(scripts, tool_turn), [], kw.pop("tool_result", None)

    def tool(code):  # `tool_result`, when given, is the first call's result
        ran.append(code)
        return first if first is not None and len(ran) == 1 else run_tool(code)

    args = dict(max_turns=5, max_tokens=1000, temperature=1.0, top_p=1.0, run_tool=tool, code_start="```",
                code_end="```", format_output=bracket)
    args.update(kw)
    ids = [SCRIPT_TOKENIZER(p)["input_ids"] for p in prompts]
    rollout = multi_turn_generate(engine, None, SCRIPT_TOKENIZER, ids, [100 + i for i in range(len(ids))], **args)
    return rollout, engine, ran


TWO_CALLS = ["Let me add.\n```py\n1+2\n```", "\nSo 3. Check:\n```python\n3+4\n```\n", "\nAnswer: 7"]
SCRIPTS = {"Q1:": ["No code: 4"], "Q2:": TWO_CALLS}


def test_scripted_rollout_masks_exactly_the_tool_turns():
    rollout, engine, ran = scripted(SCRIPTS, ["Q1:", "Q2:"])
    decode = SCRIPT_TOKENIZER.decode
    assert decode(rollout.completion_ids[0]) == "No code: 4<eos>"
    assert rollout.action_mask[0] == [1] * len(rollout.completion_ids[0])
    assert (rollout.turns, rollout.tool_calls, rollout.finish) == ([1, 3], [0, 2], ["eos", "eos"])
    assert ran == ["1+2\n", "3+4\n"]
    ids, mask, logp = rollout.completion_ids[1], rollout.action_mask[1], rollout.sampler_logp[1]
    assert decode(ids) == TWO_CALLS[0] + "[3]" + TWO_CALLS[1] + "[7]" + TWO_CALLS[2] + "<eos>"
    assert decode([t for t, m in zip(ids, mask) if m == 0]) == "[3][7]"
    assert decode([t for t, m in zip(ids, mask) if m == 1]) == "".join(TWO_CALLS) + "<eos>"
    assert logp == [-0.5 if m else 0.0 for m in mask]
    # the second turn ends inside a token: "\n```\n" completes the fence and is kept whole, with its log-prob
    second = [b for m, _, b in spans(mask) if m == 1][1]
    assert SCRIPT_TOKENIZER.convert_ids_to_tokens(ids[second - 1]) == "\n```\n"
    # each code turn took two calls (the opening fence stops the engine too), each with its own seed
    assert [len(call) for call in engine.calls] == [2, 1, 1, 1, 1] and engine.calls[0] == [(100, 1000), (101, 1000)]
    assert [call[-1][0] for call in engine.calls] == [
        101, turn_seed(101, 0, 1), turn_seed(101, 1, 0), turn_seed(101, 1, 1), turn_seed(101, 2, 0)]
    # and the budget left: "Let me add." is 11 tokens and "\n```" 1; "py\n1+2" 6 and "\n```" 1, then "[3]" 3; ...
    used = [0, 11 + 1, 11 + 1 + 6 + 1 + 3, 22 + 13 + 1, 22 + 14 + 10 + 1 + 3]
    assert [call[-1][1] for call in engine.calls] == [1000 - n for n in used]


def test_other_markers_take_one_call_per_turn():
    scripts = {"Q:": ["a <code>1+2</code>", " b <code>5-1</code>", " c"]}
    rollout, engine, ran = scripted(scripts, ["Q:"], code_start="<code>", code_end="</code>")
    assert ran == ["1+2", "5-1"] and rollout.turns == [3] and len(engine.calls) == 3
    assert SCRIPT_TOKENIZER.decode(rollout.completion_ids[0]) == "a <code>1+2</code>[3] b <code>5-1</code>[6] c<eos>"


def test_max_turns_leaves_the_last_block_unrun():
    rollout, _, ran = scripted(SCRIPTS, ["Q2:"], max_turns=2)
    assert (rollout.turns, rollout.tool_calls, rollout.finish, ran) == ([2], [1], ["max_turns"], ["1+2\n"])
    assert SCRIPT_TOKENIZER.decode(rollout.completion_ids[0]) == TWO_CALLS[0] + "[3]" + TWO_CALLS[1]
    one, _, ran = scripted(SCRIPTS, ["Q2:"], max_turns=1)
    assert (one.turns, one.tool_calls, one.finish, ran) == ([1], [0], ["max_turns"], [])


def test_the_budget_counts_model_and_tool_tokens():
    first = len(scripted(SCRIPTS, ["Q2:"], max_turns=1)[0].completion_ids[0])  # the first model turn's tokens
    cut, _, _ = scripted(SCRIPTS, ["Q2:"], max_tokens=first + 2)  # room for 2 of the 3 tool tokens "[3]"
    assert SCRIPT_TOKENIZER.decode(cut.completion_ids[0]) == TWO_CALLS[0] + "[3"
    assert cut.action_mask[0][-3:] == [1, 0, 0] and (cut.turns, cut.tool_calls, cut.finish) == ([1], [1], ["length"])
    full, _, ran = scripted(SCRIPTS, ["Q2:"], max_tokens=first)  # no room for the output: the tool is not run
    assert (len(full.completion_ids[0]), full.tool_calls, full.finish, ran) == (first, [0], ["length"], [])
    short, _, _ = scripted(SCRIPTS, ["Q1:", "Q2:"], max_tokens=5)
    assert [len(c) for c in short.completion_ids] == [5, 5] and short.finish == ["length", "length"]
    assert short.turns == [1, 1] and short.action_mask == [[1] * 5] * 2


def test_tool_statistics():
    timeout = ToolResult("timed out after 5 s", "timeout", 5.0)
    rollout, _, _ = scripted(SCRIPTS, ["Q2:"], tool_result=timeout)  # the first call times out, the second runs
    assert (rollout.tool_calls, rollout.tool_errors, rollout.tool_timeouts) == ([2], [1], [1])
    assert rollout.tool_seconds == [5.25]
    scripts = {"Q:": ["```py\nx\n```", "```py\n2\n```", "done"]}
    rollout, _, ran = scripted(scripts, ["Q:"])
    assert ran == ["x\n", "2\n"] and (rollout.tool_errors, rollout.tool_timeouts) == ([1], [0])
    assert SCRIPT_TOKENIZER.decode(rollout.completion_ids[0]) == "```py\nx\n```[error]```py\n2\n```[2]done<eos>"


def test_a_final_tool_result_ends_the_trajectory():
    boxed = ToolResult("\\boxed{3}", None, 0.1)
    rollout, _, _ = scripted(SCRIPTS, ["Q2:"], tool_result=boxed, is_final=simpletir_is_final)
    assert (rollout.turns, rollout.tool_calls, rollout.finish) == ([1], [1], ["final"])
    assert SCRIPT_TOKENIZER.decode(rollout.completion_ids[0]) == TWO_CALLS[0] + "[\\boxed{3}]"


@pytest.mark.sandbox
def test_simpletir_turns_with_the_sandbox():
    """common.engines.sandbox.run_python as the tool, in SimpleTIR's format: the output, an error's last line, and
    final_answer() ending the trajectory."""
    from common.engines.sandbox import run_python

    scripts = {"Q:": ["Add.\n```py\nprint(1 + 2)\n```", "Then:\n```py\nprint(1 / 0)\n```",
                      "So 3.\n```python\nfinal_answer(3)\n```", "never written"]}
    rollout, _, ran = scripted(scripts, ["Q:"], tool_turn=r"\nCode execution result: [^\n]*\n\n?",
                               run_tool=lambda code: run_python(FINAL_ANSWER_PREAMBLE + code),
                               format_output=simpletir_output, is_final=simpletir_is_final)
    assert SCRIPT_TOKENIZER.decode(rollout.completion_ids[0]) == (
        scripts["Q:"][0] + "\nCode execution result: 3\n\n" + scripts["Q:"][1]
        + "\nCode execution result: ZeroDivisionError: division by zero\n" + scripts["Q:"][2]
        + "\nCode execution result: \\boxed{3}\n\n")
    assert ran == ["print(1 + 2)\n", "print(1 / 0)\n", "final_answer(3)\n"]
    assert (rollout.turns, rollout.tool_calls, rollout.tool_errors, rollout.finish) == ([3], [3], [1], ["final"])
    assert rollout.tool_timeouts == [0] and rollout.tool_seconds[0] > 0


def test_a_collective_engine_is_called_while_any_process_has_rows(monkeypatch):
    """With a collective engine every process calls it in every round, with the busiest process's row count: here
    the other process has 3 rows for 7 rounds. The trajectories are those of a lone process."""
    alone, _, _ = scripted(SCRIPTS, ["Q1:", "Q2:"])
    other = iter([3] * 7 + [0] * 100)

    def all_gather_object(counts, mine):
        counts[:] = [mine, next(other)]

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)
    monkeypatch.setattr(ScriptedEngine, "collective", lambda self: True, raising=False)
    synced, engine, _ = scripted(SCRIPTS, ["Q1:", "Q2:"])
    assert [len(c) for c in engine.calls] == [3] * 7
    assert all(budget == 1 for call in engine.calls[1:] for _, budget in call[1:])  # dummies: 1 token each
    assert synced == alone


class CollectiveEngine(ScriptedEngine):
    """Every call gathers from every process, as HFEngine under FSDP does: a process that skipped one would hang."""

    def collective(self):
        return True

    def generate(self, model, prompt_ids, *args, **kwargs):
        rows = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(rows, len(prompt_ids))
        assert len(set(rows)) == 1, rows
        return super().generate(model, prompt_ids, *args, **kwargs)


def collective_child(prompt: str, out: str) -> None:
    """One of 2 gloo processes (torch.distributed's variables in the environment): the rollout of `prompt`."""
    torch.distributed.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a missed call fails
    engine = CollectiveEngine(SCRIPTS)
    rollout = multi_turn_generate(engine, None, SCRIPT_TOKENIZER, [SCRIPT_TOKENIZER(prompt)["input_ids"]], [101],
                                  max_turns=5, max_tokens=1000, temperature=1.0, top_p=1.0, run_tool=digit_sum,
                                  code_start="```", code_end="```", format_output=bracket)
    with open(out, "w") as f:
        json.dump(dict(calls=len(engine.calls), **vars(rollout)), f)
    torch.distributed.destroy_process_group()


def test_two_processes_with_a_collective_engine(tmp_path):
    """Process 0's row ends after 1 call, process 1's after 5: both make 5 calls, and each trajectory is the one a
    lone process samples."""
    from conftest import free_port

    env = {**subprocess_env(), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    procs = [subprocess.Popen([sys.executable, "-c", f"from test_multiturn import collective_child; "
                               f"collective_child({p!r}, {str(tmp_path / f'{rank}.json')!r})"],
                              cwd=os.path.dirname(__file__), env={**env, "RANK": str(rank)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank, p in enumerate(["Q1:", "Q2:"])]
    try:
        for proc in procs:
            assert proc.wait(timeout=300) == 0, proc.stdout.read()[-3000:]
    finally:
        for proc in procs:
            proc.kill()
    for rank, prompt in enumerate(["Q1:", "Q2:"]):
        got = json.loads((tmp_path / f"{rank}.json").read_text())
        alone, _, _ = scripted(SCRIPTS, [prompt])
        assert got.pop("calls") == 5 and got == vars(alone)


def test_a_completion_the_engine_ends_early_ends_the_trajectory():
    """vLLM also stops at generation_config.json's end-of-sequence tokens, which need not be the tokenizer's."""
    class EndsEarly:
        def generate(self, model, prompt_ids, seeds, *, max_tokens, temperature, top_p, stop=None):
            return [[5, 6]] * len(prompt_ids), [[-1.0, -2.0]] * len(prompt_ids)

    rollout = multi_turn_generate(EndsEarly(), None, SCRIPT_TOKENIZER, [[7], [8]], [1, 2], max_turns=5, max_tokens=10,
                                  temperature=1.0, top_p=1.0, run_tool=digit_sum, code_start="```", code_end="```",
                                  format_output=bracket)
    assert rollout.finish == ["eos", "eos"] and rollout.turns == [1, 1] and rollout.completion_ids == [[5, 6]] * 2
    assert rollout.sampler_logp == [[-1.0, -2.0]] * 2 and rollout.action_mask == [[1, 1]] * 2


def test_bad_arguments():
    with pytest.raises(ValueError, match="one seed per prompt"):
        multi_turn_generate(None, None, SCRIPT_TOKENIZER, [[1]], [1, 2], max_turns=1, max_tokens=1, temperature=1.0,
                            top_p=1.0, run_tool=digit_sum, code_start="```", code_end="```", format_output=bracket)


# ---------------------------------------------------------------- a tiny random Qwen3 that writes code fences

CODE_CHARS = "0123456789+-() \n`=aeioprtuy"  # "output", "error", "py"
TEMPERATURE = 0.9


def tiny_qwen3(vocab_size: int, seed: int = 0) -> transformers.Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=128, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
        initializer_range=0.2,  # peaked logits: fences, blocks and EOS come often enough to test every path
        pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return transformers.Qwen3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The model and tokenizer, also saved for vLLM to load."""
    path = tmp_path_factory.mktemp("tiny_code_qwen3")
    tokenizer = char_tokenizer(CODE_CHARS, FENCES)
    model = tiny_qwen3(len(tokenizer))
    tokenizer.save_pretrained(path)
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, "pad_token_id": 0}))
    return str(path), tokenizer, model


PROMPTS = ["12+3=", "what is 7", "(1+2)", "a"]
ROLLOUT = dict(max_turns=3, max_tokens=80, temperature=TEMPERATURE, top_p=1.0, run_tool=digit_sum,
               code_start="```", code_end="```", format_output=output_block)


def rollout_of(engine, model, tokenizer, rows: list[int], **kw):
    """Row r samples prompt PROMPTS[r % 4] with seed 1000 + r."""
    prompts = [tokenizer(PROMPTS[r % len(PROMPTS)])["input_ids"] for r in rows]
    return prompts, multi_turn_generate(engine, model, tokenizer, prompts, [1000 + r for r in rows],
                                        **{**ROLLOUT, **kw})


def spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal mask values."""
    out = []
    for t, m in enumerate(mask):
        if out and out[-1][0] == m:
            out[-1][2] = t + 1
        else:
            out.append([m, t, t + 1])
    return [tuple(s) for s in out]


def check_rollout(rollout, tokenizer, prompts, model, max_turns: int, max_tokens: int, atol: float) -> dict:
    """Every invariant of a rollout with the digit_sum tool and output_block; returns counts of what happened."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    seen = dict(tool_calls=0, errors=0, multi_turn=0, finish=set(), stop_inside_token=0)
    for i, (ids, logp, mask) in enumerate(zip(rollout.completion_ids, rollout.sampler_logp, rollout.action_mask)):
        assert len(ids) == len(logp) == len(mask) <= max_tokens
        assert 1 <= rollout.turns[i] <= max_turns
        runs = spans(mask)
        model_turns = [ids[a:b] for m, a, b in runs if m == 1]
        tool_turns = [ids[a:b] for m, a, b in runs if m == 0]
        assert runs[0][0] == 1 and len(model_turns) == rollout.turns[i] and len(tool_turns) == rollout.tool_calls[i]
        assert all(logp[t] == 0.0 for t in range(len(ids)) if mask[t] == 0)
        errors = seconds = 0
        for turn, tool in zip(model_turns, tool_turns):
            # the turn stopped at the token that closed its first block
            code = find_code(decode(turn), "```", "```")
            assert code is not None and find_code(decode(turn[:-1]), "```", "```") is None
            seen["stop_inside_token"] += not decode(turn).endswith("```")  # the token goes on after the fence
            result = digit_sum(code)
            expected = tokenizer(output_block(result), add_special_tokens=False)["input_ids"]
            assert tool == expected or (tool == expected[:len(tool)] and len(ids) == max_tokens)  # cut by the budget
            errors, seconds = errors + (result.error is not None), seconds + result.seconds
        assert (rollout.tool_errors[i], rollout.tool_seconds[i], rollout.tool_timeouts[i]) == (errors, seconds, 0)
        finish, last = rollout.finish[i], model_turns[-1] if runs[-1][0] == 1 else []
        if last and last[-1] == tokenizer.eos_token_id:
            assert finish == "eos"
        elif last and find_code(decode(last), "```", "```") is not None:  # a block no turn was left to run
            assert finish == ("max_turns" if rollout.turns[i] == max_turns else "length")
            assert find_code(decode(last[:-1]), "```", "```") is None
        else:
            assert finish == "length"
        assert finish != "length" or len(ids) == max_tokens
        seen["tool_calls"] += rollout.tool_calls[i]
        seen["errors"] += errors
        seen["multi_turn"] += rollout.turns[i] > 1
        seen["finish"].add(finish)
    # the sampler's log-probs of model tokens are the trainer's, on [prompt | completion]
    completions = rollout.completion_ids
    pad = tokenizer.pad_token_id
    prompt = pad_rows(prompts, pad, left=True)
    ids = torch.cat([prompt, pad_rows(completions, pad)], dim=1)
    valid = pad_rows([[1] * len(c) for c in completions], 0)
    attention = torch.cat([pad_rows([[1] * len(p) for p in prompts], 0, left=True), valid], dim=1)
    with torch.no_grad():
        trainer, _ = completion_logprobs(model, ids, attention, valid.shape[1], TEMPERATURE)
    action = pad_rows(rollout.action_mask, 0).bool()
    gap = (trainer - pad_rows(rollout.sampler_logp, 0.0))[action].abs().max().item()
    assert gap < atol, f"sampler/trainer log-prob gap on model tokens: {gap:.3g}"
    return {**seen, "gap": gap}


def test_hf_rollout_masks_budget_turns_and_logprobs(tiny):
    _, tokenizer, model = tiny
    engine = HFEngine(tokenizer, Accelerator(cpu=True))
    prompts, rollout = rollout_of(engine, model, tokenizer, list(range(24)))
    seen = check_rollout(rollout, tokenizer, prompts, model, ROLLOUT["max_turns"], ROLLOUT["max_tokens"], atol=1e-4)
    # the rollouts took every path: tool calls that failed and that ran, several turns, every way to finish
    assert seen["tool_calls"] > seen["errors"] > 0 and seen["multi_turn"] > 0, seen
    assert seen["finish"] == {"eos", "length", "max_turns"} and seen["stop_inside_token"] > 0, seen


def test_hf_rollout_does_not_depend_on_the_batch(tiny):
    _, tokenizer, model = tiny
    engine = HFEngine(tokenizer, Accelerator(cpu=True))
    _, together = rollout_of(engine, model, tokenizer, list(range(12)))
    for rows in ([5], [11, 3, 7], [7, 0, 5, 9, 2]):
        _, part = rollout_of(engine, model, tokenizer, rows)
        for j, r in enumerate(rows):
            assert part.completion_ids[j] == together.completion_ids[r]
            assert part.action_mask[j] == together.action_mask[r] and part.turns[j] == together.turns[r]
            torch.testing.assert_close(torch.tensor(part.sampler_logp[j]), torch.tensor(together.sampler_logp[r]),
                                       atol=1e-5, rtol=0)
    assert max(together.turns) > 1


def test_a_row_that_writes_no_code_is_the_single_turn_rollout(tiny):
    """Markers the model cannot write: every row ends in 1 turn, and is what the engine samples in one call."""
    _, tokenizer, model = tiny
    engine = HFEngine(tokenizer, Accelerator(cpu=True))
    prompts, rollout = rollout_of(engine, model, tokenizer, list(range(8)), code_start="<code>", code_end="</code>")
    single, logp = engine.generate(model, prompts, [1000 + r for r in range(8)], max_tokens=ROLLOUT["max_tokens"],
                                   temperature=TEMPERATURE, top_p=1.0)
    assert rollout.completion_ids == single
    torch.testing.assert_close(pad_rows(rollout.sampler_logp, 0.0), pad_rows(logp, 0.0), atol=1e-6, rtol=0)
    assert rollout.turns == [1] * 8 and rollout.tool_calls == [0] * 8
    assert rollout.action_mask == [[1] * len(c) for c in single]


def test_hf_engine_stops_at_the_token_that_completes_a_stop_string(tiny):
    _, tokenizer, model = tiny
    engine = HFEngine(tokenizer, Accelerator(cpu=True))
    prompts = [tokenizer(PROMPTS[r % 4])["input_ids"] for r in range(16)]
    kw = dict(temperature=1.0, top_p=1.0)
    free, free_logp = engine.generate(model, prompts, list(range(16)), max_tokens=40, **kw)
    stopped, stopped_logp = engine.generate(model, prompts, list(range(16)), max_tokens=40, stop=["```"], **kw)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    cut = 0
    for f, s, fl, sl in zip(free, stopped, free_logp, stopped_logp):
        assert f[:len(s)] == s  # a prefix of the free run: the same draws
        torch.testing.assert_close(torch.tensor(fl[:len(s)]), torch.tensor(sl), atol=1e-6, rtol=0)
        if "```" in decode(s):
            assert "```" not in decode(s[:-1])
            cut += len(s) < len(f)
        else:
            assert s == f
    assert cut > 0
    # one budget per row: each row is the free run's prefix of that length
    budgets = [1 + r % 7 * 6 for r in range(16)]
    short, _ = engine.generate(model, prompts, list(range(16)), max_tokens=budgets, **kw)
    assert short == [f[:b] for f, b in zip(free, budgets)]


# ---------------------------------------------------------------- vLLM (its own process)

def vllm_child(path: str, out: str) -> None:
    """Run in a process of its own: the rollout of rows 0..23 with a VLLMEngine on the saved model."""
    from common.engines.vllm_engine import VLLMEngine

    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    engine = VLLMEngine(path, accelerator=Accelerator(cpu=not torch.cuda.is_available()), max_model_len=512,
                        seed=0, dtype="float32", gpu_memory_utilization=0.2)
    prompts, rollout = rollout_of(engine, None, tokenizer, list(range(24)))
    with open(out, "w") as f:
        json.dump(dict(prompts=prompts, **vars(rollout)), f)


@pytest.mark.vllm
def test_vllm_rollout_matches_the_trainer(tiny, tmp_path):
    path, tokenizer, model = tiny
    out = tmp_path / "rollout.json"
    code = f"from test_multiturn import vllm_child; vllm_child({path!r}, {str(out)!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=subprocess_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    saved = json.loads(out.read_text())
    rollout = multiturn.MultiTurnRollout(**{k: v for k, v in saved.items() if k != "prompts"})
    atol = 1e-4 if not torch.cuda.is_available() else 0.08  # fp32 on a CPU; a GPU's kernels differ more
    seen = check_rollout(rollout, tokenizer, saved["prompts"], model, ROLLOUT["max_turns"], ROLLOUT["max_tokens"],
                         atol=atol)
    assert seen["tool_calls"] > seen["errors"] > 0 and seen["multi_turn"] > 0, seen
    assert seen["stop_inside_token"] > 0, seen
