"""A chat template as a run uses it (issue 43): imported by common/rails/outside_checks.py where a
model from outside has one and --use_chat_template is on."""


def template_problems(name: str, tokenizer, enable_thinking: bool) -> list[str]:
    """A chat template must end the prompt where the answer starts (add_generation_prompt), not with
    EOS, and end an answer with the EOS generation stops at (another end-of-turn: every completion
    runs to the limit)."""
    mark = "ANSWER_3F7A"
    eos = tokenizer.eos_token
    user = [{"role": "user", "content": "1 + 1"}]
    try:
        prompt, unprompted, turn = (
            tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen,
                                          enable_thinking=enable_thinking)
            for messages, gen in [(user, True), (user, False),
                                  (user + [{"role": "assistant", "content": mark}], False)])
    except Exception:
        # a template that refuses these turns: common/rails/checks.py tokenizer_problems names it
        return []
    fix = ("fix the template in tokenizer_config.json (chat_template.jinja), or pass "
           "--no_use_chat_template")
    header, after = turn.split(mark, 1) if mark in turn else ("", "")
    ids = tokenizer(after.lstrip(), add_special_tokens=False)["input_ids"][:1]
    end = tokenizer.convert_ids_to_tokens(ids)[0] if ids else eos
    # no header added, one due
    if prompt == unprompted and header.startswith(prompt) and header[len(prompt):].strip():
        return [f"{name}: its chat template ignores add_generation_prompt: prompts end "
                f"without the answer's header {header[len(prompt):]!r}, so the model "
                f"would go on with the question; {fix}"]
    if prompt.rstrip().endswith(eos):
        return [f"{name}: its chat template ends the prompt with the end-of-sequence token "
                f"{eos!r}: the model is told the conversation is over before it answers; {fix}"]
    if end != eos and end in tokenizer.all_special_tokens + list(tokenizer.added_tokens_encoder):
        return [f"{name}: its chat template ends an answer with {end!r}, but generation stops at "
                f"the end-of-sequence token {eos!r}, so every completion would run to "
                f"--max_completion_length; set eos_token to {end!r} in tokenizer_config.json"]
    return []
