"""Prompts: the text the model continues for a problem (`render_example`).

A string prompt of your data is asked as given (data.prompt_template null, as TRL: the text
itself, after the tokenizer's own leading special tokens); with a template (the built-in tasks
resolve to theirs) the templated question is the user message through the tokenizer's chat
template (Qwen3 thinking on/off via `enable_thinking`); a conversation goes through the chat
template whole. Also: the prompts too long for data.max_prompt_tokens, left out
(`drop_long_prompts` for a list, `prompt_fits` as training draws them), and the lines a run
prints about how it asks (`describe_prompts`, `thinking_note`).

Not here: tokenisation for the model (generation/) and grading (rewards/).
"""

from __future__ import annotations

from ibpo.config import BUILTIN_PROMPT_TEMPLATE, ConfigError, DataConfig
from ibpo.data.example import Example


def drop_long_prompts(examples: list[Example], tokenizer, cfg: DataConfig, what: str):
    """Keep the examples whose rendered prompt has at most data.max_prompt_tokens tokens.

    Memory (and `ibpo plan`) assume that bound; cutting a problem statement would change the
    problem, so a longer prompt is left out, and the count is reported. -> (kept, dropped)."""
    if not examples:
        return examples, 0
    texts = [render_example(tokenizer, e, cfg) for e in examples]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    kept = [e for e, n in zip(examples, lengths) if n <= cfg.max_prompt_tokens]
    if not kept:
        raise ConfigError(
            f"every {what} prompt is longer than data.max_prompt_tokens={cfg.max_prompt_tokens} "
            f"(shortest: {min(lengths)} tokens). Fix: raise data.max_prompt_tokens."
        )
    return kept, len(examples) - len(kept)


def prompt_fits(tokenizer, cfg: DataConfig):
    """The check a training problem passes as it is drawn (stream.Keep): None when its rendered
    prompt has at most data.max_prompt_tokens tokens, else why it is left out. Rendering and
    tokenizing as drawn, not every prompt at start, keeps a large dataset's start-up short."""

    def fits(ex: Example) -> str | None:
        text = render_example(tokenizer, ex, cfg)
        n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
        if n <= cfg.max_prompt_tokens:
            return None
        return (
            f"its prompt has {n} tokens, over data.max_prompt_tokens={cfg.max_prompt_tokens} "
            "(raise it to train on such problems)"
        )

    return fits


def prompt_template(cfg: DataConfig) -> str | None:
    """The template a string prompt is asked with: data.prompt_template; where it is None, the
    built-in tasks' (a DataConfig not passed through config.resolve), else None: the prompt
    as given."""
    if cfg.prompt_template is not None:
        return cfg.prompt_template
    return BUILTIN_PROMPT_TEMPLATE if cfg.dataset.startswith("builtin:") else None


def as_given(cfg: DataConfig) -> bool:
    """A string prompt is the model's text itself (TRL's standard format): no template and no
    system prompt, which only a chat can hold."""
    return prompt_template(cfg) is None and not cfg.system_prompt


def render_prompt(tokenizer, question: str, cfg: DataConfig) -> str:
    """The text the model continues for a string prompt: the prompt as given, after the special
    tokens the tokenizer puts in front of a text (a BOS), as TRL tokenizes it (`as_given`);
    else the chat template applied to the templated question."""
    if as_given(cfg):
        return special_prefix(tokenizer) + question
    return render_user_message(tokenizer, user_message(question, cfg), cfg)


def special_prefix(tokenizer) -> str:
    """The text of the special tokens `tokenizer` adds in front of a text (a Llama tokenizer's
    BOS; "" for most), which rollouts, tokenizing rendered prompts without them, need written."""
    cached = getattr(tokenizer, "_ibpo_special_prefix", None)
    if cached is not None:
        return cached
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x")["input_ids"]
    starts = [k for k in range(len(full) - len(plain) + 1) if full[k : k + len(plain)] == plain]
    prefix = tokenizer.decode(full[: starts[0]]) if starts and starts[0] > 0 else ""
    try:
        tokenizer._ibpo_special_prefix = prefix
    except AttributeError:  # a tokenizer that takes no new attributes: computed each time
        pass
    return prefix


def describe_prompts(tokenizer, cfg: DataConfig) -> str:
    """The line a run prints saying how it asks its problems."""
    template = prompt_template(cfg)
    if getattr(tokenizer, "chat_template", None):
        chat = "a conversation through the model's chat template"
    else:
        chat = "a conversation's messages one after another (the model has no chat template)"
    if as_given(cfg):
        return (
            "ibpo: prompts as the dataset gives them (data.prompt_template=null, as TRL does): a "
            f"string prompt as its text, {chat}. data.prompt_template='{{question}}' asks a "
            "string prompt as a chat message instead"
        )
    builtin = cfg.dataset.startswith("builtin:") and template == BUILTIN_PROMPT_TEMPLATE
    system = " after data.system_prompt" if cfg.system_prompt else ""
    return (
        f"ibpo: prompts: data.prompt_template {template!r}"
        f"{' (the built-in tasks)' if builtin else ''} as the user message{system}; {chat}"
    )


def thinking_note(tokenizer, cfg: DataConfig, max_new_tokens: int) -> str | None:
    """A note when the chat template thinks unless told not to (Qwen3's) and the recipe does not
    say: long thoughts are then cut off at max_new_tokens and score nothing."""
    template = getattr(tokenizer, "chat_template", None)
    if cfg.enable_thinking is not None or "enable_thinking" not in str(template or ""):
        return None
    return (
        "ibpo: note: this chat template thinks by default (data.enable_thinking is unset); "
        f"thoughts longer than rollout.max_new_tokens={max_new_tokens} are cut off and score 0. "
        "Set data.enable_thinking=false (or true to say so)."
    )


def user_message(question: str, cfg: DataConfig) -> str:
    """The question in data.prompt_template (the question itself without one)."""
    template = prompt_template(cfg)
    # not str.format: templates hold literal braces ("put your answer within \\boxed{}")
    return question if template is None else template.replace("{question}", question)


def render_user_message(tokenizer, user: str, cfg: DataConfig) -> str:
    """Chat template (system prompt, thinking switch) around one user message."""
    if not getattr(tokenizer, "chat_template", None):
        return user
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    messages.append({"role": "user", "content": user})
    return render_messages(tokenizer, messages, cfg)


def prompt_messages(ex: Example, cfg: DataConfig) -> list[dict]:
    """The chat a problem is asked as: a conversational prompt whole (data.system_prompt in
    front when it has no system message of its own; data.prompt_template is not applied, the
    chat is the prompt), else data.system_prompt and the templated question."""
    if ex.messages is not None:
        messages = [dict(m) for m in ex.messages]
        if cfg.system_prompt and not any(m["role"] == "system" for m in messages):
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        return messages
    messages = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt else []
    messages.append({"role": "user", "content": user_message(ex.question, cfg)})
    return messages


def render_messages(tokenizer, messages: list[dict], cfg: DataConfig) -> str:
    """A chat through the chat template (thinking switch, generation prompt); without a
    template, its messages' contents one after another."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n\n".join(str(m["content"]) for m in messages)
    extra = {} if cfg.enable_thinking is None else {"enable_thinking": cfg.enable_thinking}
    return tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **extra
    )


def render_example(tokenizer, ex: Example, cfg: DataConfig) -> str:
    """The text the model continues for a problem: its whole chat, or render_prompt (of the
    prompt exactly as the dataset gives it, when it is asked as given)."""
    if ex.messages is None:
        text = ex.given if ex.given is not None and as_given(cfg) else ex.question
        return render_prompt(tokenizer, text, cfg)
    return render_messages(tokenizer, prompt_messages(ex, cfg), cfg)
