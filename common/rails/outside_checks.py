"""Checks of a model folder and a data set brought from outside (issue 43): what a download, a copy
or another tool leaves behind. Imported by common/rails/checks.py when --model or --dataset is not a
preset's own (a preset builds its files and checks them); one line per problem naming the cause and
the fix, before any weights load."""

import json
import os
import struct

from transformers import AutoTokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from common.metrics import warn

# architectures with a language-model head
HEADS = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def model_problems(args, base) -> tuple[list[str], object]:
    """(problems, config): the folder's files, then `base` (common/rails/checks.py model_problems:
    config, tokenizer)."""
    found = [f"cannot load --model {args.model!r}: {p}" for p in file_problems(args.model)]
    return (found, None) if found else base("--model", args.model)


def file_problems(path: str) -> list[str]:
    """A file where the folder goes, a LoRA adapter, a shard the index names but the folder lacks, a
    truncated safetensors file (a download or copy that did not finish)."""
    if os.path.isfile(path):
        return [f"it is a file; pass the folder that holds it with its config.json and tokenizer "
                f"({os.path.dirname(path) or '.'})"]
    names = os.listdir(path) if os.path.isdir(path) else []
    config = read_json(path, "config.json") if "config.json" in names else {}
    # else transformers would ask
    if "auto_map" in config and config.get("model_type") not in CONFIG_MAPPING_NAMES:
        return [f"its config.json names code of its own (auto_map, model type "
                f"{config.get('model_type')!r}), which these scripts do not run (no "
                f"trust_remote_code); use a checkpoint of a type transformers has"]
    if "adapter_config.json" in names and "config.json" not in names:
        base = read_json(path, "adapter_config.json").get("base_model_name_or_path")
        return [f"it holds a LoRA adapter (adapter_config.json), not a model; merge it "
                f"into its base model {base!r} (peft's merge_and_unload, then "
                f"save_pretrained) and pass that folder"]
    index = {}
    if "model.safetensors.index.json" in names:
        index = read_json(path, "model.safetensors.index.json")
    missing = sorted(set(index.get("weight_map", {}).values()) - set(names))
    if missing:
        return [f"its model.safetensors.index.json names {missing[0]} (and {len(missing) - 1} "
                f"more), which the folder lacks: the download did not finish; fetch it again"]
    damaged = []
    for n in sorted(names):
        if n.endswith(".safetensors"):
            damage = safetensors_damage(path, n)
            if damage:
                damaged.append((n, damage))
    return [f"{n} {d}: the copy or download did not finish; copy it again" for n, d in damaged[:1]]


def read_json(folder: str, name: str) -> dict:
    """A JSON file of the folder, or {} where it does not parse (transformers' own loading then says
    why)."""
    try:
        with open(os.path.join(folder, name)) as f:
            return json.load(f)
    except ValueError:
        return {}


def safetensors_damage(folder: str, name: str) -> str | None:
    """Why a safetensors file cannot be whole (its header unreadable, or fewer bytes than it lists),
    or None."""
    size = os.path.getsize(os.path.join(folder, name))
    with open(os.path.join(folder, name), "rb") as f:
        length = struct.unpack("<Q", f.read(8))[0] if size >= 8 else size
        try:
            header = json.loads(f.read(length)) if length <= size - 8 else None
        except ValueError:
            header = None
    if not isinstance(header, dict):
        return f"is truncated or not a safetensors file ({size:,} bytes, its header does not read)"
    end = 8 + length + max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"),
                           default=0)
    return f"is truncated ({size:,} of its {end:,} bytes)" if size < end else None


def tokenizer_problems(args, config) -> list[str]:
    """AutoModelForCausalLM must load the architecture with its own head; the tokenizer's ids (its
    EOS first) must index the model's embedding; a chat template is checked by
    common/rails/template_checks.py, imported where there is one."""
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    name = f"--model {args.model!r}"
    arch = (config.architectures or [""])[0]
    if config.is_encoder_decoder:
        why = "an encoder-decoder (seq2seq) model"
    elif config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        why = "not a type AutoModelForCausalLM loads"
    elif arch and not arch.endswith(HEADS):
        why = f"saved without a language-model head ({arch}): one would be made up at random"
    else:
        why = None
    if why:
        return [f"cannot train {name}: it is a {config.model_type} model, {why}; these scripts "
                f"train decoder-only language models (an ...ForCausalLM checkpoint)"]
    # a config without one: not checked
    vocab = getattr(config.get_text_config(), "vocab_size", None) or len(tokenizer)
    resize = "or resize_token_embeddings and save the model"
    if tokenizer.eos_token_id >= vocab:
        return [f"{name}: its end-of-sequence token {tokenizer.eos_token!r} has id "
                f"{tokenizer.eos_token_id}, outside the model's vocabulary of {vocab:,}; set "
                f"eos_token in tokenizer_config.json to one of its tokens, {resize}"]
    if len(tokenizer) > vocab:
        return [f"{name}: its tokenizer has {len(tokenizer):,} tokens but the model's embedding "
                f"{vocab:,} rows, so some ids index outside it; save this model's own tokenizer "
                f"beside it, {resize}"]
    if args.use_chat_template and tokenizer.chat_template:
        from common.rails.template_checks import template_problems

        return template_problems(name, tokenizer, args.enable_thinking)
    return []


def duplicate_note(path: str, prompts: list) -> None:
    first = {}
    # a conversation (TRL's list of messages) by its text
    keys = (p if isinstance(p, str) else repr(p) for p in prompts)
    repeats = [i for i, key in enumerate(keys) if first.setdefault(key, i) != i]
    if repeats:
        warn(f"--dataset {path!r}: {len(repeats):,} of {len(prompts):,} prompts repeat an earlier "
             f"row (the first: row {repeats[0]}); they are trained on that much more often; "
             f"deduplicate the file if that is not meant")


def weight_problems(model, path: str) -> None:
    """At load (every process loads the same files): a NaN or inf weight, named, before it poisons
    every step."""
    import torch

    for name, p in model.named_parameters():
        bad = int((~torch.isfinite(p.detach())).sum())
        if bad:
            raise SystemExit(f"error: --model {path!r}: weight {name} holds {bad:,} non-finite "
                             f"values (NaN or inf): the model's files are broken; fetch or convert "
                             f"them again, or pass a good checkpoint")
