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
    --prompt_template, and `system_prompt` only where it has no system turn."""
    if not (use_chat_template and tokenizer.chat_template):
        raise ValueError("the prompts are conversations (lists of messages), which need the "
                         "tokenizer's chat template: use a model whose tokenizer has one, and "
                         "keep --use_chat_template on")
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}] + messages
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=enable_thinking)
