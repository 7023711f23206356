"""Issue 52 ("A TRL user's first hour"), item 2: data as TRL users have it. TRL's conversational prompts (lists of
{"role", "content"} messages, a system turn included) are rendered by the chat template; TRL's prompt / solution
columns take `solution` as the answer; a --dataset under a preset says which held-out set stays; the README's
example file trains the toy."""

import importlib
import json
import os
import re
import shlex
import shutil

import pytest
from conftest import REPO, read_metrics, run_script
from transformers import AutoTokenizer

from common.args import parse_args
from common.rails import checks
from common.tasks.conversations import is_conversation
from common.tasks.data import load_prompts
from common.tasks.toy import TOY_DIR

CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}A{% endif %}")
CONVERSATIONS = [
    {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "1+2="}], "solution": "3"},
    {"prompt": [{"role": "user", "content": "10+20="}], "solution": "30"},
]


@pytest.fixture(scope="module")
def chat_tokenizer(toy_workdir):
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(toy_workdir, TOY_DIR, "model"))
    tokenizer.chat_template = CHAT
    return tokenizer


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_conversations_are_rendered_by_the_chat_template_as_they_are(tmp_path, chat_tokenizer, capsys):
    path = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    out = load_prompts(chat_tokenizer, path, None, "train", "prompt", "answer", template="Q:{prompt}!",
                       system_prompt="D")
    # the row's own system turn is kept; --system_prompt only where a row has none; no --prompt_template
    assert out["prompt_text"] == ["<system>S<user>1+2=A", "<system>D<user>10+20=A"]
    assert out["answer"] == ["3", "30"] and out["solution"] == ["3", "30"]
    assert out["prompt"][0] == CONVERSATIONS[0]["prompt"]  # the reward functions get the messages, as in TRL
    assert "its column 'solution' holds the reference answers" in capsys.readouterr().err


def test_conversations_without_a_chat_template_say_which_is_needed(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    with pytest.raises(ValueError, match="the prompts are conversations .* need the tokenizer's chat template"):
        load_prompts(chat_tokenizer, path, None, "train", "prompt", "answer", use_chat_template=False)


@pytest.mark.parametrize("prompt, expected", [
    ([{"role": "user", "content": "hi"}], True),
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}], True),
    ([], False),
    ([{"role": "user"}], False),
    ([{"role": "user", "content": 3}], False),
    ([{"role": "user", "content": "  "}], False),
    ("text", False),
])
def test_what_counts_as_a_conversation(prompt, expected):
    assert is_conversation(prompt) is expected


def test_an_explicit_answer_column_is_not_replaced(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "both.jsonl", [{"prompt": "1+2=", "answer": "3", "solution": "three"}])
    assert load_prompts(chat_tokenizer, path, None, "train", "prompt", "answer")["answer"] == ["3"]


@pytest.fixture
def chat_toy(in_toy_workdir):
    """A copy of the toy model whose tokenizer has a chat template."""
    target = in_toy_workdir / "chat_toy"
    if not target.exists():
        shutil.copytree(in_toy_workdir / TOY_DIR / "model", target)
        tokenizer = AutoTokenizer.from_pretrained(target)
        tokenizer.chat_template = CHAT
        tokenizer.save_pretrained(target)
    return str(target)


SMALL = ["--batch_size", "16", "--num_generations", "4", "--micro_batch_size", "4", "--eval_steps", "0",
         "--total_steps", "2"]


def test_the_toy_trains_two_steps_on_conversations(chat_toy, in_toy_workdir):
    """TRL's conversational format, a system turn in the first row, answers in `solution`; checked before the
    weights load (common/rails/checks.py), then two steps."""
    rows = [{"prompt": [{"role": "system", "content": "+"}, {"role": "user", "content": "12+34="}],
             "solution": "46"}] + [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "solution": str(a + b)}
                                   for a, b in [(7, 8), (50, 25), (3, 4)]]
    path = write_jsonl(in_toy_workdir / "chat_rows.jsonl", rows)
    grpo = importlib.import_module("grpo")
    run = run_script(grpo, ["--preset", "toy", "--model", chat_toy, "--dataset", path, "--max_prompt_length", "40",
                            "--run_name", "chat", *SMALL])
    assert [m["step"] for m in read_metrics(run) if "reward/mean" in m] == [1, 2]


def readme_example() -> tuple[str, str, list[str]]:
    """The README's reward file, data file and command (its arguments)."""
    readme = open(os.path.join(REPO, "README.md")).read()
    section = readme[readme.index("## Your own data and reward"):readme.index("## One GPU and many")]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    data = re.search(r"cat > mine\.jsonl <<'EOF'\n(.*?)\nEOF\n", section, re.S).group(1) + "\n"
    command = re.search(r"^python grpo\.py (.*?)(?:  #.*)?$", section, re.M).group(1)
    return code, data, shlex.split(command)


def test_the_readme_example_file_is_three_rows_in_trl_s_standard_format():
    _, data, argv = readme_example()
    rows = [json.loads(line) for line in data.splitlines()]
    assert len(rows) == 3 and all(set(r) == {"prompt", "solution"} for r in rows), rows
    assert argv[:4] == ["--preset", "toy", "--dataset", "mine.jsonl"], argv


def test_the_readme_example_trains_the_toy_two_steps(in_toy_workdir, monkeypatch):
    """The README's file and reward, written where it says, and its command, shortened to 2 small steps."""
    code, data, argv = readme_example()
    (in_toy_workdir / "mine.jsonl").write_text(data)
    (in_toy_workdir / "my_rewards.py").write_text(code)
    monkeypatch.syspath_prepend(str(in_toy_workdir))  # "next to grpo.py": on the script's path
    grpo = importlib.import_module("grpo")
    run = run_script(grpo, argv + ["--run_name", "readme_data", *SMALL])
    steps = [m for m in read_metrics(run) if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2] and "reward/exact_and_short/mean" in steps[0], steps


def test_held_out_accuracy_calls_a_trl_reward_as_training_does(in_toy_workdir, monkeypatch):
    """The held-out evaluation grades with the first reward function: a TRL-style one, the README's, is called by
    keyword there too (it was called positionally, and the README's example stopped at its first evaluation with
    "got multiple values for argument 'answer'")."""
    code, data, argv = readme_example()
    (in_toy_workdir / "mine.jsonl").write_text(data)
    (in_toy_workdir / "my_rewards.py").write_text(code)
    monkeypatch.syspath_prepend(str(in_toy_workdir))
    grpo = importlib.import_module("grpo")
    small = [*SMALL[:-4], "--total_steps", "1", "--eval_steps", "1", "--eval_num_prompts", "8"]
    run = run_script(grpo, argv + ["--run_name", "readme_eval", *small])
    accuracy = [m["eval/accuracy"] for m in read_metrics(run) if "eval/accuracy" in m]
    assert len(accuracy) == 2 and all(-1 < a <= 1 for a in accuracy), accuracy  # at steps 0 and 1


def test_a_dataset_under_a_preset_says_which_held_out_set_stays(in_toy_workdir, capsys):
    grpo = importlib.import_module("grpo")
    args = parse_args(grpo.Args, ["--preset", "toy", "--dataset", "mine.jsonl"])
    notes = checks.ignored_settings(args)
    assert ("--dataset mine.jsonl under --preset toy: the held-out evaluation stays on the preset's "
            "runs/toy/test.jsonl; pass --eval_dataset FILE to evaluate on your own, or --eval_steps 0") in notes
    for quiet in (["--eval_dataset", "mine.jsonl"], ["--eval_steps", "0"], []):
        argv = ["--preset", "toy", *quiet] + (["--dataset", "mine.jsonl"] if quiet else [])
        assert not any("held-out evaluation stays" in n for n in checks.ignored_settings(parse_args(grpo.Args, argv)))


# Issue 52, item 5: wandb's project and run name. wandb is not installed here (nor in requirements-test.txt): a
# stand-in package records what wandb.init gets, as the real one would be called by accelerate's WandBTracker.
FAKE_WANDB = '''import json
import os


class _Config:
    def update(self, values, allow_val_change=False):
        pass


config = _Config()


class _Run:
    def log(self, values, step=None, **kwargs):
        pass

    def finish(self):
        pass


def init(**kwargs):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps({k: kwargs.get(k) for k in ("project", "name")}) + "\\n")
    return _Run()
'''


@pytest.fixture
def fake_wandb(tmp_path, monkeypatch):
    import sys

    site = tmp_path / "site"
    (site / "wandb").mkdir(parents=True)
    (site / "wandb" / "__init__.py").write_text(FAKE_WANDB)
    (site / "wandb-0.0.0.dist-info").mkdir()
    (site / "wandb-0.0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: wandb\nVersion: 0.0.0\n")
    monkeypatch.syspath_prepend(str(site))
    import accelerate.tracking
    from accelerate.utils import LoggerType

    # accelerate lists the installed trackers when it is imported
    monkeypatch.setattr(accelerate.tracking, "_available_trackers",
                        [*accelerate.tracking._available_trackers, LoggerType.WANDB])
    log = tmp_path / "wandb_init.jsonl"
    monkeypatch.setenv("FAKE_WANDB_LOG", str(log))
    for name in ("WANDB_PROJECT", "WANDB_NAME"):
        monkeypatch.delenv(name, raising=False)
    yield log
    sys.modules.pop("wandb", None)


@pytest.mark.parametrize("env, expected", [
    ({}, {"project": "grpo", "name": "tracked"}),
    ({"WANDB_PROJECT": "my-project", "WANDB_NAME": "first try"}, {"project": "my-project", "name": "first try"}),
])
def test_run_name_and_project_reach_wandb_init(in_toy_workdir, fake_wandb, monkeypatch, env, expected):
    """--run_name is wandb's run name and the script's name its project, unless WANDB_NAME / WANDB_PROJECT say
    otherwise (accelerate alone would pass the run's name as the project, over WANDB_PROJECT)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    grpo = importlib.import_module("grpo")
    run_name = f"tracked{len(env)}"
    run_script(grpo, ["--preset", "toy", "--report_to", "wandb", "--run_name", run_name, *SMALL[:-1], "1"])
    calls = [json.loads(line) for line in fake_wandb.read_text().splitlines()]
    assert calls == [{**expected, "name": expected["name"].replace("tracked", run_name)}]


def test_conversational_data_gives_rewards_the_completions_as_trl_does(chat_toy, in_toy_workdir):
    """For conversational prompts TRL's GRPOTrainer passes each completion as a list holding its assistant message;
    a reward written for that form (TRL's documented `completion[0]["content"]`) runs unchanged, beside the built-in
    grader (which reads either form), in the check before any weights load and in training."""
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "solution": str(a + b)}
            for a, b in [(12, 34), (7, 8), (50, 25), (3, 4)]]
    path = write_jsonl(in_toy_workdir / "chat_rows_rewards.jsonl", rows)
    (in_toy_workdir / "chat_rewards.py").write_text(
        "seen = []\n\n\n"
        "def short_content(completions, prompts, **kwargs):\n"
        "    seen.append((prompts[0], completions[0]))\n"
        "    return [-0.01 * len(completion[0]['content']) for completion in completions]\n")
    grpo = importlib.import_module("grpo")
    run = run_script(grpo, ["--preset", "toy", "--model", chat_toy, "--dataset", path, "--max_prompt_length", "40",
                            "--reward_funcs", "chat_rewards.py:short_content,toy_addition",
                            "--reward_weights", "1,1", "--run_name", "chat_rewards", *SMALL])
    assert [m["step"] for m in read_metrics(run) if "reward/mean" in m] == [1, 2]
    import chat_rewards

    prompt, completion = chat_rewards.seen[-1]
    assert prompt[0]["role"] == "user" and prompt[0]["content"].endswith("=")
    assert len(completion) == 1 and completion[0]["role"] == "assistant" and isinstance(completion[0]["content"], str)


def test_the_built_in_graders_read_conversational_completions_as_text():
    from common.tasks.math_grader import math_accuracy
    from common.tasks.rewards import conversational_completions
    from common.tasks.toy import toy_addition

    prompts = [[{"role": "user", "content": "1+2="}]] * 2
    completions = conversational_completions(prompts, ["3", "4"])
    assert completions == [[{"role": "assistant", "content": "3"}], [{"role": "assistant", "content": "4"}]]
    assert conversational_completions(["1+2="], ["3"]) == ["3"]  # text prompts: text completions
    assert toy_addition(prompts, completions, answer=["3", "3"]) == [1.0, 0.0]
    assert math_accuracy(prompts, completions, answer=["3", "3"]) == [1.0, 0.0]


def test_names_from_trl_are_answered_with_flags_that_exist():
    """Issue 68, item 1: each name common/rails/flag_names.py answers is not a flag of any script
    (else the answer would never be given), and every flag and file its answer names exists."""
    from common.rails.flag_names import ELSEWHERE
    from evals import ALGORITHMS

    scripts = {name: importlib.import_module(name) for name in ALGORITHMS}
    fields = {f for module in scripts.values() for f in module.Args.__dataclass_fields__}
    assert not set(ELSEWHERE) & fields
    named = {flag for answer in ELSEWHERE.values() for flag in re.findall(r"--(\w+)", answer)}
    assert named - {"config_file"} <= fields, named - fields
    paths = r"\w+\.py|[\w/]+/\w+\.yaml"
    files = {f for answer in ELSEWHERE.values() for f in re.findall(paths, answer)}
    assert all(os.path.isfile(os.path.join(REPO, f)) for f in files), files


@pytest.mark.peer
def test_names_from_trl_are_fields_of_its_grpo_config():
    """The names answered as TRL's are fields of TRL's GRPOConfig (the installed TRL:
    requirements-test.txt), but for the few of TRL's scripts' arguments and habits listed apart."""
    import dataclasses

    from trl import GRPOConfig

    from common.rails.flag_names import ELSEWHERE, NOT_GRPOCONFIG, SDPO_NAMES

    config = {f.name for f in dataclasses.fields(GRPOConfig)}
    grpo_names = set(ELSEWHERE) - NOT_GRPOCONFIG - set(SDPO_NAMES)
    assert grpo_names <= config, grpo_names - config
    assert not NOT_GRPOCONFIG & config


@pytest.mark.peer
def test_every_field_of_trls_sdpo_config_is_a_flag_of_sdpo_or_answered():
    """Every field TRL 1.16's SDPOConfig adds to GRPOConfig is a flag of sdpo.py, or an unknown flag answered
    with sdpo.py's name or why it has none; and the answered names are SDPOConfig's."""
    import dataclasses

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl import GRPOConfig
    from trl.experimental.sdpo import SDPOConfig

    import sdpo
    from common.rails.flag_names import SDPO_NAMES

    added = {f.name for f in dataclasses.fields(SDPOConfig)} - {f.name for f in dataclasses.fields(GRPOConfig)}
    flags = set(sdpo.Args.__dataclass_fields__)
    assert added - flags == set(SDPO_NAMES) - flags, (added - flags) ^ set(SDPO_NAMES)
    assert set(SDPO_NAMES) <= added


def test_trl_conversations_train_the_toy_as_its_text_prompts(in_toy_workdir):
    """Issue 68, item 4: TRL's conversational rows on --preset toy, whose tokenizer has a chat
    template: each renders to the token ids of its text prompt, so the toy learns from them as from
    its own rows (minutes: docs/toy.md); two steps run."""
    with open(os.path.join(TOY_DIR, "train.jsonl")) as f:
        text = [json.loads(line) for line in f][:64]
    text = [{"prompt": "12+34=", "answer": "46"}, *text]
    chats = [{"prompt": [{"role": "user", "content": r["prompt"]}], "solution": r["answer"]}
             for r in text]  # the first: {"prompt": [... "12+34="}], "solution": "46"}
    chats_path = write_jsonl(in_toy_workdir / "chats.jsonl", chats)
    text_path = write_jsonl(in_toy_workdir / "text.jsonl", text)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(TOY_DIR, "model"))
    from_chats = load_prompts(tokenizer, chats_path, None, "train", "prompt", "answer")
    from_text = load_prompts(tokenizer, text_path, None, "train", "prompt", "answer")
    assert from_chats["prompt_ids"] == from_text["prompt_ids"]
    assert from_chats["prompt_text"][0] == "12+34="
    grpo = importlib.import_module("grpo")
    argv = ["--preset", "toy", "--dataset", chats_path, "--run_name", "trl_chats", *SMALL]
    run = run_script(grpo, argv)
    assert [m["step"] for m in read_metrics(run) if "reward/mean" in m] == [1, 2]


def test_a_toy_built_before_its_chat_template_gets_it_without_a_rebuild(toy_workdir, tmp_path):
    """A cached toy of the same TOY_VERSION whose tokenizer has no template (built before it had
    one) gets it as chat_template.jinja; its weights are not touched."""
    from common.tasks.toy import CHAT_TEMPLATE, prepare_toy

    old = tmp_path / "toy"
    shutil.copytree(toy_workdir / TOY_DIR, old)
    (old / "model" / "chat_template.jinja").unlink(missing_ok=True)
    weights = (old / "model" / "model.safetensors").read_bytes()
    assert not AutoTokenizer.from_pretrained(old / "model").chat_template  # precondition
    prepare_toy(str(old))
    assert AutoTokenizer.from_pretrained(old / "model").chat_template == CHAT_TEMPLATE
    assert (old / "model" / "model.safetensors").read_bytes() == weights


def trl_page_rows() -> list[list[str]]:
    """docs/trl.md's field tables: [field, flag here, TRL default, default here] of each row."""
    rows = []
    for line in open(os.path.join(REPO, "docs", "trl.md")).read().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 5 and re.fullmatch(r"`\w+`", cells[0]) and cells[1] != "flag here":
            rows.append([c.strip("`") for c in cells[:4]])
    return rows


def test_the_trl_page_s_flags_and_defaults_are_grpo_s():
    """Issue 68, item 5: docs/trl.md names flags of grpo.py's Args with their defaults as they are,
    and maps every GRPOConfig name that an unknown flag is answered for."""
    from common.rails.flag_names import ELSEWHERE, NOT_GRPOCONFIG, SDPO_NAMES

    fields = importlib.import_module("grpo").Args.__dataclass_fields__
    rows = trl_page_rows()
    assert len(rows) > 40, rows
    for field, flag, _, ours in rows:
        if flag == "none":
            assert ours == "", field
        else:
            assert flag.startswith("--") and flag[2:] in fields, (field, flag)
            assert ours == repr(fields[flag[2:]].default), (field, flag, ours)
    # SDPOConfig's own names are sdpo.py's page's (docs/estimators/sdpo.md)
    assert set(ELSEWHERE) - NOT_GRPOCONFIG - set(SDPO_NAMES) <= {row[0] for row in rows}


@pytest.mark.peer
def test_the_trl_page_s_fields_and_defaults_are_trl_s():
    """docs/trl.md's first column are fields of the installed TRL's GRPOConfig, with its defaults;
    the fields of the same name in both are all in it."""
    import dataclasses

    from trl import GRPOConfig

    config = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    rows = trl_page_rows()
    for field, _, theirs, _ in rows:
        assert field in config and theirs == repr(config[field]), (field, theirs, config.get(field))
    shared = set(config) & set(importlib.import_module("grpo").Args.__dataclass_fields__)
    assert shared <= {row[0] for row in rows}, shared - {row[0] for row in rows}
