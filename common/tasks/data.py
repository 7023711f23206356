"""Prompt datasets: load with `datasets.load_dataset`, map columns, apply the prompt template,
tokenize.

Every row of the returned dataset keeps all of its original columns (reward functions receive them
as keyword arguments) plus:
    prompt       the question as the user wrote it (column `prompt_column`): text, or TRL's
                 conversational format, a list of {"role", "content"} messages
    answer       the reference answer (column `answer_column`, or TRL's `solution` where the data
                 has no `answer` column: `answer_column_of`), where the dataset has one
    prompt_text  what the model sees: the template, then the tokenizer's chat template if it has one
    prompt_ids   its token ids
"""

import importlib
import os

from common.metrics import warn

# --preset NAME: the module holding its defaults (PRESETS) and building what it reads
# (prepare_preset), imported only when the preset is asked for: the toys' common/tasks/toy.py and
# common/tasks/toy_tir.py, the real model's common/tasks/smollm2.py
PRESET_MODULES = {"toy": "common.tasks.toy", "toy_tir": "common.tasks.toy_tir",
                  "smollm2": "common.tasks.smollm2"}
PRESET_NAMES = tuple(PRESET_MODULES)


def preset_defaults(preset: str | None) -> dict:
    """The defaults a --preset sets (none without one)."""
    if preset is None:
        return {}
    return importlib.import_module(PRESET_MODULES[preset]).PRESETS[preset]


# The papers' datasets: `--dataset gsm8k` stands for the hub id, config, splits and columns below.
DATASET_PRESETS = {
    "gsm8k": dict(path="openai/gsm8k", name="main", split="train", eval_split="test",
                  prompt_column="question", answer_column="answer"),
    "math": dict(path="DigitalLearningGmbH/MATH-lighteval", name="default", split="train",
                 eval_split="test", prompt_column="problem", answer_column="solution"),
    "numina": dict(path="AI-MO/NuminaMath-TIR", name=None, split="train", eval_split="test",
                   prompt_column="problem", answer_column="solution"),
    "deepscaler": dict(path="agentica-org/DeepScaleR-Preview-Dataset", name=None, split="train",
                       eval_split=None, prompt_column="problem", answer_column="answer"),
}
LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
# datasets reads its own cache offline, not hf download's
OFFLINE = ("without network, load it once where the hub is reachable (datasets.load_dataset({0!r}, "
           "{1!r})), then set HF_HUB_OFFLINE=1 to use the local cache only")


def resolve_dataset(dataset: str, split: str | None, prompt_column: str | None,
                    answer_column: str | None, eval_split: str | None = None) -> dict:
    """Expand a preset name into its hub id, config, splits and columns; explicit values win."""
    spec = dict(path=dataset, name=None, split="train", eval_split="test", prompt_column="prompt",
                answer_column="answer")
    spec.update(DATASET_PRESETS.get(dataset, {}))
    for key, value in dict(split=split, prompt_column=prompt_column, answer_column=answer_column,
                           eval_split=eval_split).items():
        if value is not None:
            spec[key] = value
    return spec


def looks_local(path: str) -> bool:
    """A path that can only mean a local file or folder: not a hub id (`name` or `org/name`). Such a
    path that does not exist must say so, instead of being tried on the hub (slowly, and blamed on
    it)."""
    return (os.path.exists(path) or path.startswith((".", "/", "~")) or path.count("/") >= 2
            or os.path.splitext(path)[1] in LOCAL_FORMATS)


def load_rows(path: str, name: str | None, split: str):
    """A datasets.Dataset from a hub id, a local .jsonl/.json/.parquet/.csv file, a directory of
    such files, or a `save_to_disk` folder."""
    import datasets  # here, not at the top: a refusal of the flags needs no data library

    ext = os.path.splitext(path)[1]
    try:
        if os.path.isfile(path) and ext in LOCAL_FORMATS:
            return datasets.load_dataset(LOCAL_FORMATS[ext], data_files=path, split="train")
        if os.path.isdir(path) and os.path.exists(os.path.join(path, "dataset_info.json")):
            ds = datasets.load_from_disk(path)
            return ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        if looks_local(path) and not os.path.exists(path):
            raise FileNotFoundError(f"no such file or directory: {path}")
        return datasets.load_dataset(path, name, split=split)
    except Exception as e:
        # a local file or folder that does not parse: its own first error, not the hub's
        if os.path.exists(path):
            root = e
            while (root.__cause__ or root.__context__) is not None:
                root = root.__cause__ or root.__context__
            first = (str(root).strip().splitlines() or [""])[0]
            raise ValueError(f"Could not read {path!r}: {type(root).__name__}: {first}; a .jsonl "
                             f"file holds one JSON object per line, in UTF-8") from e
        # not "use a preset"
        preset = next((k for k, v in DATASET_PRESETS.items() if v["path"] == path), None)
        if preset:
            hint = f"it is the hub data set of the preset {preset}"
        else:
            hint = (f"pass a hub id reachable from here, a local .jsonl/.json/.parquet/.csv file "
                    f"or folder, or one of the presets: {', '.join(DATASET_PRESETS)}")
        raise ValueError(f"Could not load dataset {path!r} (config {name!r}, split {split!r}): "
                         f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}; {hint}; "
                         f"{OFFLINE.format(path, name)}") from e


def answer_column_of(column_names: list[str], answer_column: str | None) -> str | None:
    """The column that holds the reference answers: `answer_column`, or `solution` (TRL's standard
    prompt/solution data) where the data has no `answer` column but has that one."""
    if answer_column == "answer" and "answer" not in column_names and "solution" in column_names:
        return "solution"
    return answer_column


def format_prompt(tokenizer, prompt, template: str, system_prompt: str,
                  use_chat_template: bool, enable_thinking: bool) -> str:
    """`template` with {prompt} filled in, wrapped in the tokenizer's chat template when it has
    one. A conversational prompt (a list of messages) is rendered as it is by the chat template,
    as TRL renders it: no `template`, and `system_prompt` only where it has no system turn."""
    if not isinstance(prompt, str):  # TRL's conversational format: common/tasks/conversations.py
        from common.tasks.conversations import render

        return render(tokenizer, prompt, system_prompt, use_chat_template, enable_thinking)
    text = template.replace("{prompt}", prompt)
    if not (use_chat_template and tokenizer.chat_template):
        return text
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": text}
    ]
    # enable_thinking is Qwen3's switch; chat templates without it ignore the extra variable.
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=enable_thinking)


def load_prompts(tokenizer, path: str, name: str | None, split: str, prompt_column: str,
                 answer_column: str | None, template: str = "{prompt}", system_prompt: str = "",
                 use_chat_template: bool = True, enable_thinking: bool = False,
                 max_prompt_length: int | None = None):
    """Load, check the columns, format and tokenize; prompts longer than max_prompt_length are
    dropped."""
    ds = load_rows(path, name, split)
    if answer_column_of(ds.column_names, answer_column) != answer_column:
        warn(f"{path} has no column {answer_column!r}: its column 'solution' holds the reference "
             f"answers (TRL's prompt/solution format); pass --answer_column to name another")
        answer_column = answer_column_of(ds.column_names, answer_column)
    for flag, column in [("--prompt_column", prompt_column), ("--answer_column", answer_column)]:
        if column is not None and column not in ds.column_names:
            raise ValueError(
                f"Dataset {path!r} (split {split!r}) has no column {column!r}; its columns are "
                f"{ds.column_names}. Name the right one with {flag}."
            )
    if "{prompt}" not in template:
        raise ValueError(f"--prompt_template must contain '{{prompt}}', got {template!r}")

    def prepare(row):
        text = format_prompt(tokenizer, row[prompt_column], template, system_prompt,
                             use_chat_template, enable_thinking)
        # a chat template writes its BOS
        add_special_tokens = not (use_chat_template and tokenizer.chat_template)
        ids = tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        out = {"prompt": row[prompt_column], "prompt_text": text, "prompt_ids": ids}
        if answer_column is not None:
            out["answer"] = row[answer_column]
        return out

    ds = ds.map(prepare, desc="Formatting prompts")
    if max_prompt_length is not None:
        before = len(ds)
        ds = ds.filter(lambda row: len(row["prompt_ids"]) <= max_prompt_length)
        if len(ds) == 0:
            raise ValueError(f"All {before} prompts of {path!r} are longer than "
                             f"--max_prompt_length {max_prompt_length}; raise it.")
        if len(ds) < before:
            warn(f"{before - len(ds):,} of the {before:,} prompts of {path} "
                 f"({(before - len(ds)) / before:.1%}) are longer than --max_prompt_length "
                 f"{max_prompt_length} tokens and were dropped; raise it to keep them")
    return ds
