"""Multi-turn, tool-integrated rollouts (TIR): the model writes Python in a code block, a tool runs
it, the output is appended as a tool turn, and the model goes on from there. Engine-agnostic: any
engine of common/engines/rollout.py.

    rollout = multi_turn_generate(engine, model, tokenizer, prompt_ids, seeds, max_turns=5,
                                  max_tokens=8000, temperature=1.0, top_p=1.0, run_tool=run_python,
                                  code_start=CODE_START, code_end=CODE_END,
                                  format_output=simpletir_output)
    rollout.completion_ids[i]  every token after the prompt: model turns and tool turns, EOS kept
                               if generated
    rollout.sampler_logp[i]    the sampler's log-prob of each model token; 0.0 on tool tokens
    rollout.action_mask[i]     1 on the model's own tokens, 0 on tool-output tokens (docs/tools.md:
                               they are context, not actions; the training loop multiplies its
                               `mask` by this)

A model turn ends at a closed code block, EOS or the token budget. Only a closed block with a turn
left to take runs the tool; its output, `format_output(result)` tokenized and cut to what is left of
the budget, follows as a tool turn and the model takes the next turn. `max_tokens` caps model and
tool tokens together (SimpleTIR and CTPO, section 4.1: 8,000 per trajectory, up to 5 turns). A row
that never writes code ends after 1 turn.

Model tokens are never re-tokenized (SimpleTIR re-tokenizes the decoded text, which can change the
token ids): a turn stops at the token that completes `code_end` (the engines' `stop`), and that
token, whole, and its log-prob are what the trainer sees. When `code_end` also occurs outside a
block (it is ``` as is the opening fence), the engine stops there too; the turn then goes on in
another engine call (a "segment") from where it stopped.

Seeds: each engine call of a row samples with turn_seed(seed, turn, segment), so a trajectory
depends only on its row's seed (rollout.sample_seed(seed, step, prompt, sample)), never on which
rows share a call, nor on how many processes there are. All rows still active take each call
together; finished rows drop out.

Needs: a tokenizer that encodes any tool output (byte-level BPE does) and has eos_token_id; with
vLLM, a max_model_len of at least the longest prompt plus max_tokens (a later turn's prompt holds
the earlier turns).
"""

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from common.engines.rollout import single_turn

# The prompt of SimpleTIR (Xue et al. 2025, arXiv:2509.02479), whose TIR setting CTPO (section 4.1)
# trains in: the authors' repository github.com/ltzheng/SimpleTIR (commit e7b5b44),
# recipe/simpletir/config/simpletir_trainer.yaml `data.prompt`, verbatim; their dataset puts it
# before the question, in the user turn (recipe/simpletir/utils/ dataset/rl_dataset.py). The CTPO
# paper does not print it. As a --prompt_template: "{prompt}" is the question.
TIR_PROMPT_TEMPLATE = (
    "Solve the following problem step by step. You now have the ability to selectively write "
    "executable Python code to enhance your reasoning process. The Python code will be executed "
    "by an external sandbox, and the output (after \"Code execution result: \") is returned to "
    "aid your reasoning and help you arrive at the final answer. The Python code should be "
    "complete scripts, including necessary imports.\n"
    "\n"
    "Code Format:\n"
    "Each code snippet is wrapped between ```. You need to use `print()` to output intermediate "
    "results.\n"
    "\n"
    "Answer Format:\n"
    "You can use the `final_answer()` function in the code to return your final answer. For "
    "example, to answer the User Question: What is the result of the 5 + 3 + 1294.678?, you can "
    "write:\n"
    "```py\n"
    "answer = 5 + 3 + 1294.678\n"
    "final_answer(answer)\n"
    "```\n"
    "\n"
    "You can also use \\boxed to return your answer. The last part of your response should be:\n"
    "\\boxed{'The final answer goes here.'}\n"
    "\n"
    "User Question:\n"
    "{prompt}"
)
# SimpleTIR's code blocks (agent_utils.py: r"```(?:py|python)?\n(.*?)\n```"): a fence, its info
# string ("py"), a newline, the code, a fence. find_code reads the same blocks; it does not insist
# on a newline before the closing one.
CODE_START = "```"
CODE_END = "```"
# What SimpleTIR puts before every code block it runs (agent_utils.py execute_predictions): the
# prompt's final_answer().
FINAL_ANSWER_PREAMBLE = '\ndef final_answer(result):\n    print(f"\\\\boxed{{{result}}}")\n\n'
SIMPLETIR_OUTPUT_CHARS = 512  # agent_utils.py truncate_content(..., max_length=512)


def simpletir_output(result) -> str:
    """SimpleTIR's tool turn: "\\nCode execution result: {text}\\n", where text is the output, or
    after an error only its last line (their error_n_line = 1), cut to 512 characters (half from
    each end); "" when nothing was printed. `result`: common.engines.sandbox's ToolResult or
    anything with .output and .error."""
    text = result.output
    if result.error is not None:
        text = (text.strip().splitlines() or [result.error])[-1]
    if not text:
        return ""
    if len(text) > SIMPLETIR_OUTPUT_CHARS:
        half = SIMPLETIR_OUTPUT_CHARS // 2
        note = (f"\n..._This content has been truncated to stay below "
                f"{SIMPLETIR_OUTPUT_CHARS} characters_...\n")
        text = text[:half] + note + text[-half:]
    return f"\nCode execution result: {text}\n"


def simpletir_is_final(result) -> bool:
    """SimpleTIR ends a trajectory after a tool turn that printed a \\boxed answer (final_answer()
    does)."""
    return "\\boxed{" in result.output


@dataclass
class MultiTurnRollout:
    """Per row: the tokens after the prompt (model and tool turns), the sampler's log-probs (0.0 on
    tool tokens), the action mask (1 = the model's own token) and the row's statistics. `finish`:
    "eos", "length" (the token budget), "max_turns" (the last turn closed a code block that was not
    run) or "final" (the `is_final` tool result)."""

    completion_ids: list[list[int]]
    sampler_logp: list[list[float]]
    action_mask: list[list[int]]
    turns: list[int]
    tool_calls: list[int]
    tool_errors: list[int]
    tool_timeouts: list[int]
    tool_seconds: list[float]
    finish: list[str | None]

    @classmethod
    def empty(cls, rows: int) -> "MultiTurnRollout":
        return cls(*([[] for _ in range(rows)] for _ in range(3)), [1] * rows, [0] * rows,
                   [0] * rows, [0] * rows, [0.0] * rows, [None] * rows)


def turn_seed(seed: int, turn: int, segment: int = 0) -> int:
    """The seed of one engine call of a row: the row's own seed for its first call (a row that
    writes no code is sampled as a single-turn rollout is), then (turn, segment) mixed in as
    rollout.sample_seed mixes its indices (injective for indices below 2**20)."""
    if turn == segment == 0:
        return seed
    return ((seed * 1_048_573 + turn) * 1_048_573 + segment) % (2**63 - 1)


def find_code(text: str, code_start: str, code_end: str) -> str | None:
    """The code of the first closed block in `text`, or None. A code_start that is a Markdown fence
    (```) opens the block with the rest of its line: that is the info string ("```py"), and the code
    starts on the next line."""
    start = text.find(code_start)
    if start < 0:
        return None
    begin = start + len(code_start)
    if code_start.startswith("```") and not code_start.endswith("\n"):
        newline = text.find("\n", begin)
        if newline < 0:
            return None
        begin = newline + 1
    end = text.find(code_end, begin)
    return None if end < 0 else text[begin:end]


def is_timeout(result) -> bool:
    return result.error == "timeout"  # common.engines.sandbox's ToolResult names the kind of error


def run_tools(run_tool: Callable, codes: list[str], workers: int) -> list:
    if not codes:
        return []
    # threads suffice: the sandbox runs subprocesses
    with ThreadPoolExecutor(min(workers, len(codes))) as pool:
        return list(pool.map(run_tool, codes))


def rows_this_call(engine, active: int) -> int:
    """Rows in this round's engine call. A collective engine (rollout.HFEngine under FSDP or ZeRO-3,
    vLLM with tensor parallelism) needs every process in every call, with as many rows: each process
    then calls while any has rows left, with the busiest one's count (the rest dummies)."""
    collective = getattr(engine, "collective", None)
    if collective is None or not collective():
        return active
    counts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(counts, active)
    return max(counts)


def multi_turn_generate(engine, model, tokenizer, prompt_ids: list[list[int]], seeds: list[int], *,
                        max_turns: int, max_tokens: int, temperature: float, top_p: float,
                        run_tool: Callable, code_start: str, code_end: str,
                        format_output: Callable[..., str],
                        is_final: Callable[..., bool] | None = None,
                        tool_workers: int = 8) -> MultiTurnRollout:
    """One trajectory per prompt (module docstring). `run_tool(code)` returns something with
    .output, .error (None on success, "timeout" for a timeout) and .seconds, as
    common.engines.sandbox.run_python does; up to `tool_workers` run at once. `is_final(result)`: a
    tool result after which the trajectory ends (SimpleTIR: simpletir_is_final)."""
    if len(seeds) != len(prompt_ids):
        raise ValueError(f"one seed per prompt: got {len(seeds)} seeds for "
                         f"{len(prompt_ids)} prompts")
    if max_turns < 1 or max_tokens < 1:
        raise ValueError(f"max_turns and max_tokens must be at least 1, got "
                         f"{max_turns} and {max_tokens}")
    out = MultiTurnRollout.empty(len(prompt_ids))
    # where each row's current model turn begins in its completion
    turn_start = [0] * len(prompt_ids)
    segment = [0] * len(prompt_ids)
    dummy = prompt_ids[0] if prompt_ids else [tokenizer.eos_token_id]
    active = list(range(len(prompt_ids)))
    while True:
        calls = rows_this_call(engine, len(active))
        if calls <= 0:
            break
        fill = calls - len(active)
        ids, logps = engine.generate(
            model, [prompt_ids[i] + out.completion_ids[i] for i in active] + [dummy] * fill,
            [turn_seed(seeds[i], out.turns[i] - 1, segment[i]) for i in active] + [0] * fill,
            max_tokens=[max_tokens - len(out.completion_ids[i]) for i in active] + [1] * fill,
            temperature=temperature, top_p=top_p, stop=[code_end])
        tool_rows = []
        codes = []
        for i, new, logp in zip(active, ids, logps):
            completion = out.completion_ids[i]
            completion += new
            out.sampler_logp[i] += logp
            out.action_mask[i] += [1] * len(new)
            left = max_tokens - len(completion)
            code = find_code(tokenizer.decode(completion[turn_start[i]:], skip_special_tokens=True),
                             code_start, code_end)
            if new and new[-1] == tokenizer.eos_token_id:
                out.finish[i] = "eos"
            elif code is not None:
                if out.turns[i] >= max_turns:
                    out.finish[i] = "max_turns"
                elif left == 0:
                    out.finish[i] = "length"
                else:
                    tool_rows.append(i)
                    codes.append(code)
            elif left > 0 and code_end in tokenizer.decode(new, skip_special_tokens=True):
                # stopped at a code_end that closes no block (an opening fence): the turn goes on
                segment[i] += 1
            elif left == 0:
                out.finish[i] = "length"
            else:
                # The engine ended it short of the budget: an end-of-sequence token other than the
                # tokenizer's (vLLM also stops at generation_config.json's eos_token_id).
                out.finish[i] = "eos"
        for i, result in zip(tool_rows, run_tools(run_tool, codes, tool_workers)):
            completion = out.completion_ids[i]
            tool_ids = tokenizer(format_output(result), add_special_tokens=False)["input_ids"]
            tool_ids = tool_ids[: max_tokens - len(completion)]
            completion += tool_ids
            out.sampler_logp[i] += [0.0] * len(tool_ids)
            out.action_mask[i] += [0] * len(tool_ids)
            out.tool_calls[i] += 1
            out.tool_errors[i] += result.error is not None
            out.tool_timeouts[i] += is_timeout(result)
            out.tool_seconds[i] += result.seconds
            if is_final is not None and is_final(result):
                out.finish[i] = "final"
            elif len(completion) >= max_tokens:
                out.finish[i] = "length"
            else:
                out.turns[i] += 1
                turn_start[i] = len(completion)
                segment[i] = 0
        active = [i for i in active if out.finish[i] is None]
    return out


@dataclass(frozen=True)
class Tool:
    """What a training script's --tool names: the code-block markers, the program the sandbox runs
    for a block's code, how its result becomes the tool turn's text, and which results end the
    trajectory."""

    code_start: str
    code_end: str
    program: Callable[[str], str]
    format_output: Callable[..., str]
    is_final: Callable[..., bool] | None = None


def calculator_output(result) -> str:
    """The TIR toy's calculator turn (common/tasks/toy_tir.py): "=<digits>\\n", or "=E\\n" when the
    call failed or printed anything but a whole number (a traceback, True, 1e+20: the TIR toy's
    tokenizer encodes only its own characters)."""
    text = result.output.strip()
    return f"={text}\n" if result.error is None and re.fullmatch(r"[0-9]+", text) else "=E\n"


TOOLS = {  # --tool NAME
    "simpletir": Tool(CODE_START, CODE_END, lambda code: FINAL_ANSWER_PREAMBLE + code,
                      simpletir_output, simpletir_is_final),
    # "[123+456]" runs print(123+456) in the sandbox; one call per model turn ("[" opens, "]"
    # closes)
    "toy": Tool(code_start="[", code_end="]", program=lambda code: f"print({code})",
                format_output=calculator_output, is_final=None),
}


def sample_completions(engine, model, tokenizer, prompt_ids: list[list[int]], seeds: list[int], *,
                       max_tokens: int, temperature: float, top_p: float, max_turns: int = 1,
                       tool: str = "simpletir") -> MultiTurnRollout:
    """The training loop's rollouts. max_turns 1: one engine.generate call, every token the model's
    (`finish`: "eos" or "length"), exactly as before tools existed. max_turns > 1:
    multi_turn_generate with `TOOLS[tool]`, each block run by common.engines.sandbox.run_python."""
    if max_turns == 1:
        out = MultiTurnRollout.empty(len(prompt_ids))
        out.completion_ids, out.sampler_logp, out.action_mask, out.finish = single_turn(
            engine, model, tokenizer, prompt_ids, seeds, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p)
        return out
    from common.engines.sandbox import run_python

    spec = TOOLS[tool]
    return multi_turn_generate(engine, model, tokenizer, prompt_ids, seeds, max_turns=max_turns,
                               max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                               run_tool=lambda code: run_python(spec.program(code)),
                               code_start=spec.code_start, code_end=spec.code_end,
                               format_output=spec.format_output, is_final=spec.is_final)


def tool_metrics(rollout: MultiTurnRollout) -> dict[str, float]:
    """This process's tool/* metrics of one sampling round (the loop averages them over
    processes)."""
    rows = len(rollout.turns)
    tokens = sum(map(len, rollout.action_mask))
    return {"tool/turns_mean": sum(rollout.turns) / rows,
            "tool/calls_mean": sum(rollout.tool_calls) / rows,
            "tool/error_frac": sum(rollout.tool_errors) / max(sum(rollout.tool_calls), 1),
            "tool/timeout_frac": sum(rollout.tool_timeouts) / max(sum(rollout.tool_calls), 1),
            "tool/seconds": sum(rollout.tool_seconds),
            "tool/masked_token_frac": 1 - sum(map(sum, rollout.action_mask)) / max(tokens, 1)}


def multiturn_problems(tool: str) -> list[str]:
    """A known --tool, and a sandbox this machine can start (bubblewrap)."""
    from common.engines.sandbox import SandboxUnavailable, isolation

    if tool not in TOOLS:
        return [f"--tool {tool!r}: choose one of {sorted(TOOLS)}"]
    try:
        isolation()
    except SandboxUnavailable as e:
        return [f"--max_turns > 1 runs model-written code: {e}"]
    return []
