"""Reward models as reward functions: a sequence-classification model scores each prompt with
its completion, as TRL's GRPOTrainer scores with one.

* `reward_model(model, tokenizer)`: a loaded model (any module whose output has `.logits`, its
  first logit per sequence the score) and its tokenizer -> a reward function. The text scored
  is the prompt followed by the completion; a conversation with its completion goes through the
  tokenizer's chat template whole. Batches of `batch_size`, no gradient, on the model's device.
* `hub_reward_model(name)`: the same for a Hub id or a local folder, loaded on first call
  (AutoModelForSequenceClassification with one label, and its tokenizer) onto this process's
  GPU, else the CPU; `reward.functions` may name one (`org/name`).

Its memory is not in `ibpo plan`'s estimate: a reward model sits beside the policy.

Not here: how reward functions are called and combined (functions.py).
"""

from __future__ import annotations

from typing import Any

from ibpo.config import ConfigError

BATCH = 16  # sequences per forward of a reward model


def reward_model(model, tokenizer, name: str | None = None, batch_size: int = BATCH):
    """A reward function scoring with `model` (see the module docstring)."""

    def score(prompts, completions, **kwargs) -> list[float]:
        return _scores(model, tokenizer, prompts, completions, batch_size)

    score.__name__ = name or _model_name(model)
    return score


def hub_reward_model(name: str, batch_size: int = BATCH):
    """A reward function for the sequence-classification model `name` (a Hub id or a local
    folder), loaded when first called."""
    loaded: dict[str, Any] = {}

    def score(prompts, completions, **kwargs) -> list[float]:
        if not loaded:
            loaded.update(zip(("model", "tokenizer"), _load(name)))
        return _scores(loaded["model"], loaded["tokenizer"], prompts, completions, batch_size)

    score.__name__ = name.rstrip("/").split("/")[-1]
    return score


def _load(name: str):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForSequenceClassification.from_pretrained(name, num_labels=1)
    except OSError as e:
        raise ConfigError(
            f"reward.functions={name!r}: could not load it as a reward model ({e}). Fix: give "
            "a sequence-classification model's Hub id (with network access) or local folder"
        ) from None
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    return model.to(device).eval(), tokenizer


def _model_name(model) -> str:
    path = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return path.rstrip("/").split("/")[-1] or type(model).__name__


def _scores(model, tokenizer, prompts, completions, batch_size: int) -> list[float]:
    import torch

    texts = [_text(tokenizer, p, c) for p, c in zip(prompts, completions)]
    if tokenizer.pad_token is None:  # many reward models' tokenizers have none: EOS pads
        tokenizer.pad_token = tokenizer.eos_token
    device = next(model.parameters()).device
    out: list[float] = []
    for lo in range(0, len(texts), batch_size):
        enc = tokenizer(
            texts[lo : lo + batch_size],
            return_tensors="pt",
            padding=True,
            padding_side="right",
            add_special_tokens=False,
        )
        with torch.inference_mode():
            logits = model(**{k: v.to(device) for k, v in enc.items()}).logits
        out.extend(logits[:, 0].float().cpu().tolist())
    return out


def _text(tokenizer, prompt, completion) -> str:
    if isinstance(prompt, list):  # a conversation and its one-message completion
        messages = list(prompt) + list(completion)
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return prompt + completion
