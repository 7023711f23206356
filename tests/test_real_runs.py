"""What a real run can meet (issue 43): a real model, a real tokenizer, a real cluster. Each case of `REAL_RUNS` is
held by a test, here or in the file it names; docs/safety.md's table "What a real run can meet" lists the same cases
(tests/test_docs.py holds the two equal).

The refusals (`REFUSED`) run the way the command line would (parse_args, then the script's main) in this process,
with weight loading made to fail the test, as tests/test_rails.py's tables do; the model folders are made here: the
toy's model cut or changed, or a real tokenizer (SmolLM2's, ChatML) beside a tiny model.
"""

import errno
import importlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import test_rails
import torch
import transformers
from conftest import read_metrics, run_script, subprocess_env
from safetensors.torch import load_file, save_file
from test_rails import SMALL, refusal

from common.args import parse_args
from common.tasks.toy import build_model, build_tokenizer

quick_toy, workdir, no_weights = test_rails.quick_toy, test_rails.workdir, test_rails.no_weights  # its fixtures

# (case, what now happens, the test that holds it). docs/safety.md lists these rows, in this order.
REAL_RUNS = [
    ("a half-written model.safetensors in --model (a copy or download cut short)",
     "refused before any weights load, naming the file and its missing bytes", "test_refused[truncated]"),
    ("a sharded model with a shard missing (an interrupted download)", "refused, naming the missing shard",
     "test_refused[missing_shard]"),
    ("--model naming the weights file instead of its folder", "refused, naming the folder to pass",
     "test_refused[a_file]"),
    ("--model naming a LoRA adapter folder", "refused: merge it into its base model (named)",
     "test_refused[adapter]"),
    ("a NaN or inf weight in the model (or its reference: the same files)",
     "stops at load, naming the tensor (it was blamed on a weight push)", "test_a_nan_weight_is_named_at_load"),
    ("an encoder-decoder (seq2seq) model such as T5", "refused before any weights load",
     "test_refused[seq2seq]"),
    ("an encoder-only model such as BERT", "refused: it has no language-model head",
     "test_refused[encoder]"),
    ("a base model saved without its head (...Model, not ...ForCausalLM)",
     "refused: a head would be made up at random", "test_refused[headless]"),
    ("a model type this transformers does not know", "refused in one line naming the type",
     "test_refused[unknown_type]"),
    ("a model that needs its own code (auto_map in config.json: trust_remote_code)",
     "refused before transformers asks on the terminal whether to run it", "test_refused[remote_code]"),
    ("a hub model that needs its own code", "refused at once, not after a question on the terminal",
     "test_code_of_its_own_is_refused_without_a_prompt"),
    ("a tokenizer with more tokens than the model's embedding", "refused, naming both sizes",
     "test_refused[vocab]"),
    ("an end-of-sequence token outside the model's vocabulary", "refused, naming the id and the vocabulary",
     "test_refused[eos_outside]"),
    ("a chat template that ignores add_generation_prompt", "refused: the prompt would lack the answer's header",
     "test_refused[no_generation_prompt]"),
    ("a chat template whose end-of-turn is not the tokenizer's EOS (the real SmolLM2 tokenizer, its EOS set to its "
     "end-of-text token)",
     "refused: every completion would run to the limit; set eos_token", "test_refused[end_of_turn]"),
    ("a chat template that ends the prompt with EOS", "refused", "test_refused[eos_in_prompt]"),
    ("real chat templates: Qwen3's (thinking on or off), Llama 3's, Gemma's, SmolLM2's",
     "accepted; Gemma's with its end-of-text token as EOS (its base tokenizer's) refused",
     "test_real_chat_templates_pass"),
    ("a tokenizer that adds a BOS, with a chat template that writes one too",
     "one BOS (the template's); without a template, the tokenizer's own (it had none)", "test_one_bos"),
    ("a tokenizer without tokenizer files, or without an EOS; a template refusing a system turn",
     "refused (tests/test_rails.py's TRAIN_CASES)",
     "test_rails.py::test_bad_training_input_is_refused_before_any_weights_load"),
    ("every prompt longer than --max_prompt_length", "refused before the weights load (it was after)",
     "test_refused[all_too_long]"),
    ("benchmark questions longer than --max_prompt_length", "refused before the weights load (it was after)",
     "test_refused[benchmark_too_long]"),
    ("a data set with duplicate prompts", "warned: how many, and the first", "test_duplicate_prompts_are_warned"),
    ("chat-format rows (a list of messages in the prompt column) and a model without a chat template",
     "refused, naming the model and the fix (with one, TRL's conversational format is rendered by "
     "it)",
     "test_refused[messages]"),
    ("a data file with no rows, or a prompt column of another name (question, problem)",
     "refused, naming the columns it has (tests/test_rails.py)",
     "test_rails.py::test_bad_training_input_is_refused_before_any_weights_load"),
    ("reference answers that are numbers or None (GSM8K-like columns)", "graded as text; None scores 0",
     "test_rewards.py::test_references_that_are_numbers_or_none"),
    ("a reward module that does not import", "refused before any weights load, naming the import error",
     "test_rails.py::test_bad_training_input_is_refused_before_any_weights_load"),
    ("--max_completion_length 0 (or any number out of range)", "refused (tests/test_rails.py)",
     "test_rails.py::test_bad_training_input_is_refused_before_any_weights_load"),
    ("a data file that is not UTF-8", "refused, naming the rows (tests/test_rails.py)",
     "test_rails.py::test_bad_training_input_is_refused_before_any_weights_load"),
    ("a --config recipe that sets preset:", "the preset's defaults apply, as with --preset (they did not)",
     "test_a_recipe_preset_applies_its_defaults"),
    ("--max_prompt_length + --max_completion_length beyond the model's context", "warned, naming both",
     "test_a_context_longer_than_the_model_s_is_warned"),
    ("a pad token that is also the EOS, or one inside a prompt", "attended to in the prompt; masks from lengths",
     "test_common.py::test_a_pad_token_inside_a_prompt_is_attended_to"),
    ("--save_steps larger than --total_steps", "warned: only the last step is saved",
     "test_save_steps_beyond_the_run_is_warned"),
    ("an output folder that cannot be made (a file in the way, no permission)", "refused in one line",
     "test_refused[output_dir]"),
    ("a disk that fills during a checkpoint save", "one line: no space left on device; the last good checkpoint",
     "test_a_full_disk_during_a_save_is_one_line"),
    ("a disk (or a quota, or a file size limit) that runs out in the middle of a save's model weights or "
     "optimizer state (torch.save's writer then says only \"unexpected pos\")",
     "one line naming what ran out and the last good checkpoint; it loads back",
     "test_a_disk_that_fills_in_the_middle_of_a_save"),
    ("a metrics.jsonl or args_history.jsonl ending in half a line (a killed run) on --resume_from",
     "the half line is dropped with a warning and the run resumes (it was a JSON traceback)",
     "test_a_half_written_metrics_line_is_dropped_on_resume"),
    ("a slow (network) file system for the output folder", "the save's seconds are logged: time/checkpoint",
     "test_the_time_a_checkpoint_takes_is_logged"),
    ("preemption: SIGTERM from the scheduler", "a clean stop naming the checkpoint to resume",
     "test_train.py::test_ctrl_c_prints_one_line_with_the_checkpoint_and_how_to_resume"),
    ("a damaged checkpoint (a full disk or killed copy during an earlier save)",
     "skipped for the intact one before it, or refused when named",
     "test_train.py::test_a_damaged_checkpoint_is_refused_or_skipped_for_the_intact_one_before"),
    ("a lagged run resumed under another process count", "refused in one line",
     "test_offpolicy.py::test_a_lagged_checkpoint_resumed_under_another_process_count_is_refused_in_one_line"),
    ("two jobs on one run folder", "the second is refused (a lock)",
     "test_rails.py::test_a_run_folder_in_use_is_locked"),
    ("no network to the hub (a compute node)", "one line in seconds naming HF_HUB_OFFLINE",
     "test_rails.py::test_hub_ids_without_network_fail_in_seconds_naming_the_fix"),
    ("a reward function returning None", "refused by the trial call before any weights load",
     "test_refused[reward_none]"),
    ("a reward function returning None for one sample (TRL: it does not apply there) that no other function scores",
     "refused, naming the functions and the sample",
     "test_refused[reward_one_none]"),
    ("a reward function returning the wrong number of rewards", "refused", "test_refused[reward_length]"),
    ("a reward function returning NaN", "refused, naming the sample", "test_refused[reward_nan]"),
    ("a reward function returning numpy values, bools or a tensor", "taken as floats",
     "test_numpy_and_bool_rewards_are_taken"),
    ("a reward beyond +-1e15 (inf in float32 statistics)", "stops naming the function and bound",
     "test_rewards.py::test_a_reward_too_large_for_float32_statistics_names_its_function"),
    ("a reward function that hangs (a grading service)", "stopped at --reward_timeout in one line",
     "test_rewards.py::test_a_reward_that_never_returns_is_stopped_at_its_time_limit"),
    ("a NaN loss mid-run", "stops without saving, naming the last good checkpoint",
     "test_rails.py::test_a_nan_loss_stops_the_run_without_saving"),
]


def returns_none(prompts, completions, **_):
    return None


def one_none(prompts, completions, **_):
    return [None] + [1.0] * (len(completions) - 1)


def one_reward(prompts, completions, **_):
    return [1.0]


def nan_reward(prompts, completions, **_):
    return [float("nan")] * len(completions)


def toy_folder(root, name: str, tokenizer=None, config=None, weights=True):
    """A model folder under bad/: the toy's config (or `config`), `tokenizer` (the toy's) and a small weights file."""
    folder = root / "bad" / name
    tokenizer = tokenizer or build_tokenizer()
    (config or build_model(build_tokenizer(), seed=0).config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if weights:
        save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
    return str(folder.relative_to(root))


def smollm2_tokenizer(smollm2_workdir, **changes):
    from common.tasks.smollm2 import SMOLLM2_DIR

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_workdir / SMOLLM2_DIR / "model"))
    for key, value in changes.items():
        setattr(tokenizer, key, value)
    return tokenizer


def smollm2_config(smollm2_workdir):
    from common.tasks.smollm2 import SMOLLM2_DIR

    return transformers.AutoConfig.from_pretrained(str(smollm2_workdir / SMOLLM2_DIR / "model"))


def make_truncated(root, _):
    folder = root / "bad" / "truncated"
    shutil.copytree(root / "runs" / "toy" / "model", folder, dirs_exist_ok=True)  # made whole again, then cut
    size = os.path.getsize(folder / "model.safetensors")
    os.truncate(folder / "model.safetensors", size // 2)
    return ["--model", "bad/truncated"]


def make_missing_shard(root, _):
    folder = root / "bad" / "sharded"
    tokenizer = build_tokenizer()
    build_model(tokenizer, seed=0).save_pretrained(folder, max_shard_size="200KB")
    tokenizer.save_pretrained(folder)
    shards = sorted(n for n in os.listdir(folder) if n.startswith("model-0"))
    os.remove(folder / shards[-1])
    return ["--model", "bad/sharded"]


def make_adapter(root, _):
    folder = root / "bad" / "adapter"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Qwen/Qwen3-4B", "r": 8}))
    save_file({"w": torch.zeros(2)}, str(folder / "adapter_model.safetensors"))
    return ["--model", "bad/adapter"]


def make_t5(root, _):
    config = transformers.T5Config(vocab_size=len(build_tokenizer()), d_model=8, num_layers=1, num_heads=1)
    return ["--model", toy_folder(root, "t5", config=config)]


def make_bert(root, _):
    config = transformers.BertConfig(vocab_size=len(build_tokenizer()), hidden_size=8, num_hidden_layers=1,
                                     num_attention_heads=1, architectures=["BertForMaskedLM"])
    return ["--model", toy_folder(root, "bert", config=config)]


def make_headless(root, _):
    config = build_model(build_tokenizer(), seed=0).config
    config.architectures = ["Qwen3Model"]
    return ["--model", toy_folder(root, "headless", config=config)]


def make_unknown_type(root, _):
    path = toy_folder(root, "unknown_type")
    config = json.loads((root / path / "config.json").read_text())
    (root / path / "config.json").write_text(json.dumps({**config, "model_type": "qwen9"}))
    return ["--model", path]


def make_remote_code(root, _):
    path = toy_folder(root, "remote_code")
    config = {"model_type": "internlm2", "architectures": ["InternLM2ForCausalLM"],
              "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config"}}
    (root / path / "config.json").write_text(json.dumps(config))
    return ["--model", path]


def make_vocab(root, _):
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(4)])
    return ["--model", toy_folder(root, "vocab", tokenizer=tokenizer)]


def make_eos_outside(root, _):
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"eos_token": "<|end|>"})
    return ["--model", toy_folder(root, "eos_outside", tokenizer=tokenizer)]


def real_tokenizer_folder(name: str, **changes):
    def make(root, smollm2_workdir):
        tokenizer = smollm2_tokenizer(smollm2_workdir, **changes)
        return ["--model", toy_folder(root, name, tokenizer=tokenizer, config=smollm2_config(smollm2_workdir))]
    return make


CHATML_NO_GENERATION_PROMPT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
                               "'<|im_end|>\n' }}{% endfor %}")
EOS_AS_GENERATION_PROMPT = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
                            "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ eos_token }}{% endif %}")


# Real templates, as their models ship them (Qwen3's: the parts a user and an assistant turn reach).
QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'
            + content.lstrip('\\n') }}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""
LLAMA3 = ("{{- bos_token }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}{%- if "
          "add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
GEMMA = ("{{ bos_token }}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else "
         "message['role'] %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")


def test_real_chat_templates_pass(smollm2_workdir):
    """No false refusal: SmolLM2's template, Qwen3's with thinking on or off (its answer header then holds an empty
    think block the prompt lacks), Llama 3's and Gemma's with their end-of-turn as EOS (as their instruct tokenizers
    set it); Gemma's with <eos>, as its base tokenizer has it, is refused (generation would not stop)."""
    from common.rails.template_checks import template_problems

    def tokenizer(template: str, eos: str, added: tuple = ()):
        tok = smollm2_tokenizer(smollm2_workdir)
        tok.add_special_tokens({"additional_special_tokens": list(added)})
        tok.chat_template, tok.eos_token = template, eos
        return tok

    assert template_problems("m", smollm2_tokenizer(smollm2_workdir), False) == []
    for thinking in (False, True):
        assert template_problems("m", tokenizer(QWEN3, "<|im_end|>"), thinking) == []
    llama = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>")
    assert template_problems("m", tokenizer(LLAMA3, "<|eot_id|>", llama), False) == []
    gemma = ("<start_of_turn>", "<end_of_turn>", "<eos>")
    assert template_problems("m", tokenizer(GEMMA, "<end_of_turn>", gemma), False) == []
    [refused] = template_problems("m", tokenizer(GEMMA, "<eos>", gemma), False)
    assert "ends an answer with '<end_of_turn>', but generation stops at the end-of-sequence token '<eos>'" in refused


def make_all_too_long(root, _):
    return ["--max_prompt_length", "2"]


def make_benchmark_too_long(root, _):
    return ["--eval_steps", "1", "--eval_benchmarks", "toy", "--eval_num_prompts", "4", "--max_prompt_length", "5"]


def make_messages(root, _):
    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}] * 2
    (root / "bad" / "messages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["--dataset", "bad/messages.jsonl", "--model", "bad/plain"]  # its tokenizer: no template


def make_output_dir(root, _):
    return ["--output_dir", "bad/empty.jsonl/runs", "--run_name", "blocked"]


def reward(name: str):
    return lambda root, _: ["--reward_funcs", f"test_real_runs:{name}"]


REFUSED = {  # id: (make the bad input under the working directory -> the flags, a piece of the one line)
    "truncated": (make_truncated, "model.safetensors is truncated ("),
    "missing_shard": (make_missing_shard, "which the folder lacks: the download did not finish"),
    "a_file": (lambda root, _: ["--model", "runs/toy/model/model.safetensors"],
               "it is a file; pass the folder that holds it with its config.json and tokenizer (runs/toy/model)"),
    "adapter": (make_adapter, "it holds a LoRA adapter (adapter_config.json), not a model; merge it into its base "
                              "model 'Qwen/Qwen3-4B'"),
    "seq2seq": (make_t5, "it is a t5 model, an encoder-decoder (seq2seq) model"),
    "encoder": (make_bert, "it is a bert model, saved without a language-model head (BertForMaskedLM)"),
    "headless": (make_headless, "saved without a language-model head (Qwen3Model): one would be made up at random"),
    "unknown_type": (make_unknown_type, "qwen9"),
    "remote_code": (make_remote_code, "its config.json names code of its own (auto_map, model type 'internlm2'), "
                                      "which these scripts do not run (no trust_remote_code)"),
    "vocab": (make_vocab, "its tokenizer has 18 tokens but the model's embedding 14 rows"),
    "eos_outside": (make_eos_outside, "its end-of-sequence token '<|end|>' has id 14, outside the model's vocabulary"),
    "no_generation_prompt": (real_tokenizer_folder("no_gen", chat_template=CHATML_NO_GENERATION_PROMPT),
                             "its chat template ignores add_generation_prompt: prompts end without the answer's "
                             "header '<|im_start|>assistant\\n'"),
    "end_of_turn": (real_tokenizer_folder("end_of_turn", eos_token="<|endoftext|>"),
                    "its chat template ends an answer with '<|im_end|>', but generation stops at the end-of-sequence "
                    "token '<|endoftext|>'"),
    "eos_in_prompt": (real_tokenizer_folder("eos_in_prompt", chat_template=EOS_AS_GENERATION_PROMPT),
                      "its chat template ends the prompt with the end-of-sequence token '<|im_end|>'"),
    "all_too_long": (make_all_too_long, "prompts of 'runs/toy/train.jsonl' are longer than --max_prompt_length 2"),
    "benchmark_too_long": (make_benchmark_too_long, "benchmark 'toy' has prompts of up to"),
    "messages": (make_messages, "the prompts are conversations (lists of messages), which need "
                                "the tokenizer's chat template, and that of --model bad/plain"),
    "output_dir": (make_output_dir, "cannot make the run folder 'bad/empty.jsonl/runs/blocked'"),
    "reward_none": (reward("returns_none"), "reward function 'returns_none' returned NoneType, expected a list"),
    "reward_one_none": (reward("one_none"), "every reward function (one_none) returned None at sample 0"),
    "reward_length": (reward("one_reward"), "reward function 'one_reward' returned 1 rewards for 2 completions"),
    "reward_nan": (reward("nan_reward"), "reward function 'nan_reward' returned nan at sample 0"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused(workdir, no_weights, capsys, request, case):
    make, expected = REFUSED[case]
    real = request.getfixturevalue("smollm2_workdir") if getattr(make, "__qualname__", "").startswith(
        "real_tokenizer_folder") else None
    import grpo

    flags = make(workdir, real)
    message = refusal(lambda: run_script(grpo, SMALL + flags), capsys)
    assert expected in message, message


def test_a_nan_weight_is_named_at_load(workdir, capsys):
    """A NaN in one tensor of the model's files: named at load, not 'a weight push that did not take effect' at
    the end of step 1."""
    import grpo

    folder = workdir / "bad" / "nan_weight"
    shutil.copytree(workdir / "runs" / "toy" / "model", folder)
    weights = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name][3, 5] = float("nan")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    message = refusal(lambda: run_script(grpo, SMALL + ["--model", "bad/nan_weight", "--run_name", "nan_w"]), capsys)
    assert message == ("error: --model 'bad/nan_weight': weight model.layers.1.mlp.up_proj.weight holds 1 non-finite "
                       "values (NaN or inf): the model's files are broken; fetch or convert them again, or pass a "
                       "good checkpoint")


def test_the_command_line_prints_one_line_and_no_traceback(workdir):
    """Real processes: a truncated model (refused by the checks), prompts all longer than --max_prompt_length
    (refused as the data loads, before the weights) and a NaN weight (stopped at load): exit 1, one error line."""
    make_truncated(workdir, None)
    folder = workdir / "bad" / "nan_cli"
    shutil.copytree(workdir / "runs" / "toy" / "model", folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"][0] = float("inf")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "grpo.py")
    cases = {"model.safetensors is truncated": ["--model", "bad/truncated"],
             "are longer than --max_prompt_length 2": ["--max_prompt_length", "2", "--run_name", "cli_long"],
             "weight model.norm.weight holds 1 non-finite values": ["--model", "bad/nan_cli", "--run_name", "cli_nan"]}
    running = {said: subprocess.Popen([sys.executable, script, *SMALL, "--report_to", "none", *flags], cwd=workdir,
                                      env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for said, flags in cases.items()}
    for said, process in running.items():
        out, err = process.communicate(timeout=300)
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert process.returncode == 1 and "Traceback" not in out + err, (said, err[-3000:])
        assert len(errors) == 1 and said in errors[0], (said, err[-3000:])


def test_code_of_its_own_is_refused_without_a_prompt(workdir, monkeypatch):
    """common/rails/checks.py's model check (hub ids, presets) never lets transformers ask on the terminal whether to
    run a model's own code (it waits for an answer): trust_remote_code=False, refused at once."""
    import builtins

    from common.rails.checks import model_problems

    asked = []
    monkeypatch.setattr(builtins, "input", lambda *a: asked.append(a) or "")
    (path,) = make_remote_code(workdir, None)[1:]
    [problem], _ = model_problems("--model", path)
    assert "contains custom code" in problem and asked == []


def test_one_bos(workdir):
    """A tokenizer that adds BOS (Llama's, Gemma's) and a chat template that writes {{ bos_token }}: the prompt holds
    one BOS, the template's, not two; without a chat template, the tokenizer's own (it had none: ids were tokenized
    without special tokens)."""
    from tokenizers.processors import TemplateProcessing

    from common.tasks.data import load_prompts

    tokenizer = build_tokenizer(chat_template=None)  # first, without a template
    tokenizer.add_special_tokens({"bos_token": "<s>"})
    bos = tokenizer.bos_token_id
    tokenizer._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    assert tokenizer("1+1=")["input_ids"][0] == bos  # it adds one
    plain = load_prompts(tokenizer, "runs/toy/train.jsonl", None, "train", "prompt", "answer")
    assert [ids[:2].count(bos) for ids in plain["prompt_ids"][:3]] == [1, 1, 1] and plain["prompt_ids"][0][1] != bos
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chat = load_prompts(tokenizer, "runs/toy/train.jsonl", None, "train", "prompt", "answer")
    assert [ids.count(bos) for ids in chat["prompt_ids"][:3]] == [1, 1, 1]
    assert chat["prompt_ids"][0][0] == bos


def test_duplicate_prompts_are_warned(workdir, capsys):
    from common.rails import checks

    rows = [{"prompt": p, "answer": "2"} for p in ["1+1=", "0+2=", "1+1=", "2+0=", "1+1=", "0+2="]]
    (workdir / "bad" / "dups.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = parse_args(importlib.import_module("grpo").Args, SMALL + ["--dataset", "bad/dups.jsonl"])
    checks.check_args(args, num_processes=1)
    assert ("--dataset 'bad/dups.jsonl': 3 of 6 prompts repeat an earlier row (the first: row 2); they are trained on "
            "that much more often") in capsys.readouterr().err
    checks.check_args(parse_args(importlib.import_module("grpo").Args, SMALL), num_processes=1)
    assert "repeat an earlier row" not in capsys.readouterr().err  # the preset's own data: checked by its preset


def test_a_recipe_preset_applies_its_defaults(workdir):
    """`preset: toy` in a --config file: the toy's model, data and sizes, as `--preset toy` gives; the recipe's and
    the command line's values still win."""
    import grpo

    (workdir / "bad" / "toy_recipe.yaml").write_text("preset: toy\nbatch_size: 8\n")
    args = parse_args(grpo.Args, ["--config", "bad/toy_recipe.yaml", "--num_generations", "2"])
    by_flag = parse_args(grpo.Args, ["--preset", "toy", "--batch_size", "8", "--num_generations", "2"])
    assert args == by_flag and args.model == "runs/toy/model" and args.batch_size == 8
    (workdir / "bad" / "bad_preset.yaml").write_text("preset: toys\n")
    with pytest.raises(SystemExit, match="unknown --preset 'toys'"):
        parse_args(grpo.Args, ["--config", "bad/bad_preset.yaml"])


def test_a_context_longer_than_the_model_s_is_warned(workdir, capsys):
    from common.rails import checks

    limit = build_model(build_tokenizer(), seed=0).config.max_position_embeddings
    args = parse_args(importlib.import_module("grpo").Args, SMALL + ["--max_completion_length", str(limit)])
    checks.check_args(args, num_processes=1)
    assert (f"--max_prompt_length + --max_completion_length = {args.max_prompt_length + limit} exceeds the model's "
            f"max_position_embeddings {limit}") in capsys.readouterr().err


def test_save_steps_beyond_the_run_is_warned(workdir):
    from common.rails import checks

    args = parse_args(importlib.import_module("grpo").Args, SMALL + ["--save_steps", "500", "--total_steps", "50"])
    assert "--save_steps 500 > --total_steps 50: only the last step is saved" in checks.ignored_settings(args)


def test_a_full_disk_during_a_save_is_one_line(workdir, tmp_path, monkeypatch):
    """The disk fills while step 2 is saved (OSError ENOSPC; torch.save says it in a RuntimeError): one line, the
    unfinished copy removed, step 1 intact."""
    from accelerate import Accelerator

    from common.run_folder.checkpoints import save_checkpoint

    tokenizer, accelerator = build_tokenizer(), Accelerator(cpu=True)
    model = build_model(tokenizer, seed=0)
    save_checkpoint(accelerator, model, tokenizer, str(tmp_path), 1)
    for error in (OSError(errno.ENOSPC, "No space left on device"),
                  RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 123 vs 456: "
                               "PytorchStreamWriter failed writing file data/0: file write failed (No space left on "
                               "device)")):
        def full(*args, error=error, **kwargs):
            raise error

        monkeypatch.setattr(type(model), "save_pretrained", full)
        with pytest.raises(SystemExit) as exit_info:
            save_checkpoint(accelerator, model, tokenizer, str(tmp_path), 2)
        message = str(exit_info.value)
        assert message == (f"error: no space left on device while saving {tmp_path}/checkpoints/step_2; the last "
                           f"good checkpoint is {tmp_path}/checkpoints/step_1: free space (or keep fewer with "
                           f"--save_total_limit) and resume with --resume_from {tmp_path}")
        assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_1"]
    monkeypatch.setattr(type(model), "save_pretrained", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "x")))
    with pytest.raises(OSError):  # another error is raised as it is
        save_checkpoint(accelerator, model, tokenizer, str(tmp_path), 2)


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs at tmp_path/disk where this process may mount one (root), else None."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)]
    mounted = shutil.which("mount") is not None and subprocess.run(mount, capture_output=True).returncode == 0
    yield disk if mounted else None
    if mounted:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)  # a mapped file may still hold it


def room_left(path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


@pytest.mark.parametrize("room", ["tmpfs", "file_size_limit"])
@pytest.mark.parametrize("where", ["model.safetensors", "optimizer.bin"])
def test_a_disk_that_fills_in_the_middle_of_a_save(workdir, tmp_path, small_disk, monkeypatch, room, where):
    """Issue 55: the room runs out in the middle of the model's weights (safetensors says why in its text) or of the
    optimizer's state (torch.save's writer says only "unexpected pos 480704 vs 480596"). On a small tmpfs (ENOSPC;
    root mounts one) and under a file size limit (RLIMIT_FSIZE: EFBIG). One line, the unfinished copy removed, step
    1 intact; once there is room, step 1 loads back and step 2 saves."""
    import resource

    from accelerate import Accelerator

    from common.run_folder import repair
    from common.run_folder.checkpoints import save_checkpoint
    from common.run_folder.resume import find_checkpoint

    if room == "tmpfs" and small_disk is None:
        pytest.skip("mounting a tmpfs needs root; the file size limit case runs without")
    run_dir = str(small_disk) if room == "tmpfs" else str(tmp_path / "run")
    tokenizer, accelerator = build_tokenizer(), Accelerator(cpu=True)
    model = accelerator.prepare(build_model(tokenizer, seed=0))
    optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters()))
    model(input_ids=torch.tensor([[1, 2, 3, 4]]), labels=torch.tensor([[1, 2, 3, 4]])).loss.backward()
    optimizer.step()  # AdamW's moments exist: the optimizer's state is the save's largest file
    save_checkpoint(accelerator, model, tokenizer, run_dir, 1)
    step_1 = os.path.join(run_dir, "checkpoints", "step_1")
    written = sorted((os.path.join(d, f) for d, _, names in os.walk(step_1) for f in names),
                     key=lambda f: os.stat(f).st_mtime_ns)  # in the order the save wrote them
    sizes = [os.path.getsize(f) for f in written]
    target = written.index(os.path.join(step_1, "state", where))
    before = sizes[:target]
    message = f"while saving {run_dir}/checkpoints/step_2; the last good checkpoint is {step_1}: "
    if room == "tmpfs":
        block = os.statvfs(run_dir).f_frsize
        headroom = sum(-(-size // block) * block for size in before) + sizes[target] // 2 // block * block
        with open(os.path.join(run_dir, "filler"), "wb") as f:
            f.write(bytes(room_left(run_dir) - headroom))
        assert room_left(run_dir) == headroom
        message = "error: no space left on device " + message + "free space (or keep fewer with --save_total_limit)"
    else:
        limit = (max(before, default=0) + sizes[target]) // 2
        assert max(before, default=0) < limit < sizes[target]  # the first file the limit stops is the target
        message = ("error: a file reached the file size limit (ulimit -f) " + message +
                   "raise the limit (ulimit -f unlimited)")
    message += f" and resume with --resume_from {run_dir}"
    errors, disk_full = [], repair.disk_full
    monkeypatch.setattr(repair, "disk_full", lambda error, *a: errors.append(error) or disk_full(error, *a))
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    try:
        if room == "file_size_limit":
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
        with pytest.raises(SystemExit) as exit_info:
            save_checkpoint(accelerator, model, tokenizer, run_dir, 2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(exit_info.value) == message
    if where == "optimizer.bin":  # torch.save's writer, the error the issue saw: no errno, no reason in its text
        assert [type(e).__name__ for e in errors] == ["RuntimeError"] and "unexpected pos" in str(errors[0])
    else:  # safetensors names the reason in its text
        assert [type(e).__name__ for e in errors] == ["SafetensorError"]
    assert sorted(os.listdir(os.path.join(run_dir, "checkpoints"))) == ["step_1"]
    assert find_checkpoint(run_dir) == step_1  # intact: every file its manifest names, whole
    if room == "tmpfs":
        os.remove(os.path.join(run_dir, "filler"))
    saved = load_file(os.path.join(step_1, "model", "model.safetensors"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    accelerator.load_state(os.path.join(step_1, "state"))
    weights = accelerator.unwrap_model(model).state_dict()
    assert all(torch.equal(weights[name], tensor) for name, tensor in saved.items())
    save_checkpoint(accelerator, model, tokenizer, run_dir, 2)
    assert find_checkpoint(run_dir) == os.path.join(run_dir, "checkpoints", "step_2")


def test_a_half_written_metrics_line_is_dropped_on_resume(workdir, capsys):
    """A run killed while writing metrics.jsonl (or args_history.jsonl) leaves half a line: the resume drops it with
    a warning and goes on; the file reads whole afterwards (it was a JSONDecodeError traceback after the weights
    loaded)."""
    import snib

    run = run_script(snib, SMALL + ["--total_steps", "2", "--save_steps", "1", "--run_name", "killed"])
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write('{"step": 3, "reward/mean": 0.')
    with open(os.path.join(run, "args_history.jsonl"), "a") as f:
        f.write('{"step": 2, "args": {"batch_')
    run_script(snib, SMALL + ["--total_steps", "3", "--resume_from", run])
    err = capsys.readouterr().err
    assert "metrics.jsonl line 3 is not whole JSON (a run killed while writing it?); dropped" in err
    assert "args_history.jsonl line 2 is not whole JSON" in err
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3]


def test_the_time_a_checkpoint_takes_is_logged(workdir):
    """An output folder on a slow network file system: the save's seconds are their own metric, on the steps that
    save, instead of a step time that grows for no reason shown."""
    import gspo

    run = run_script(gspo, SMALL + ["--total_steps", "2", "--save_steps", "2", "--run_name", "timed_save"])
    assert ["time/checkpoint" in m for m in read_metrics(run)] == [False, True]


def test_numpy_and_bool_rewards_are_taken():
    from common.tasks.rewards import compute_rewards

    funcs = [lambda p, c, **_: np.array([1.0, 0.0]), lambda p, c, **_: [True, False],
             lambda p, c, **_: torch.tensor([0.5, 0.25]), lambda p, c, **_: [np.float32(2), np.int64(1)]]
    total, _ = compute_rewards(funcs, None, ["a", "b"], ["x", "y"], {})
    assert total.tolist() == [4.5, 1.25]


def test_every_real_run_case_names_a_test():
    """Each REAL_RUNS row names a test function (here, or file.py::name) and, for test_refused, one of its cases."""
    here = os.path.dirname(os.path.abspath(__file__))
    for _, _, test in REAL_RUNS:
        file, _, name = test.rpartition("::")
        name, _, case = name.partition("[")
        with open(os.path.join(here, file or "test_real_runs.py")) as f:
            assert f"def {name}(" in f.read(), test
        assert not case or case[:-1] in REFUSED, test
    assert {t.partition("[")[2][:-1] for _, _, t in REAL_RUNS if t.startswith("test_refused[")} == set(REFUSED)
