"""TRL's conversational format: a prompt that is a list of {"role", "content"} messages (a system
turn included), rendered by the tokenizer's chat template as it is, as TRL renders it (imported only
for such data: common/tasks/data.py format_prompt, common/rails/checks.py data_problems)."""


def is_conversation(prompt) -> bool:
    """TRL's conversational format: a non-empty list of {"role": ..., "content": ...} messages with
    text content (a system turn included)."""
    return (isinstance(prompt, list) and len(prompt) > 0
            and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str) for m in prompt)
            and any(m["content"].strip() for m in prompt))


def render(tokenizer, prompt: list, system_prompt: str, use_chat_template: bool,
           enable_thinking: bool) -> str:
    """The conversation through the chat template, with the generation prompt: no
    --prompt_template, and `system_prompt` only where it has no system turn. Without a template,
    or with one that refuses the turns, a ValueError names the model and the fix."""
    model = tokenizer.name_or_path
    if not use_chat_template:
        raise ValueError("the prompts are conversations (lists of messages), which need the "
                         "tokenizer's chat template: keep --use_chat_template on")
    if not tokenizer.chat_template:
        raise ValueError(f"the prompts are conversations (lists of messages), which need the "
                         f"tokenizer's chat template, and that of --model {model} has none: use "
                         f"a model whose tokenizer has one (--preset toy's has), give it one "
                         f"(tokenizer.chat_template = ..., then save_pretrained), or write the "
                         f"prompts as text")
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             enable_thinking=enable_thinking)
    except Exception as e:  # jinja's TemplateError, or what a template raises
        roles = ", ".join(m["role"] for m in messages)
        raise ValueError(f"the chat template of --model {model} refuses a conversation of "
                         f"turns {roles} ({type(e).__name__}: {e}); drop the turns it does not "
                         f"take (a system turn, often)") from None
