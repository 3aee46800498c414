"""Turning user text into prompt tokens: raw, or through the tokenizer's chat template."""

from __future__ import annotations

from typing import Any


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer: Any, text: str, *, system: str | None = None, chat: bool | None = None,
                  template_kwargs: dict | None = None) -> list[int]:
    """Token ids for ``text``.

    Args:
        tokenizer: mlx-lm's ``TokenizerWrapper``.
        text: the user's message (chat) or the raw prompt.
        system: optional system message (chat mode only).
        chat: ``True`` applies the chat template, ``False`` encodes raw text, ``None`` chooses chat when the
            tokenizer has a template.
        template_kwargs: extra variables for the chat template (e.g. ``{"enable_thinking": False}``).

    Raises:
        ValueError: chat mode asked for but the tokenizer has no template, or ``system`` given in raw mode.
    """
    use_chat = has_chat_template(tokenizer) if chat is None else chat
    if use_chat:
        if not has_chat_template(tokenizer):
            raise ValueError("this model's tokenizer has no chat template: use --raw")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **(template_kwargs or {})))
    if system:
        raise ValueError("--system needs chat mode (--chat)")
    return list(tokenizer.encode(text))


def response_primer(tokenizer: Any, text: str | None, *, raw: bool) -> list[int]:
    """The tokens of ``text``, the start of the answer a chat prompt is followed by (``--prefill-response``; none
    for ``None``).

    Raises:
        ValueError: ``text`` with a raw prompt (write it into the prompt itself), an empty ``text``, or a tokenizer
            without a chat template.
    """
    if text is None:
        return []
    if raw or not has_chat_template(tokenizer):
        raise ValueError("--prefill-response starts the assistant's answer of a chat prompt: with --raw (or without "
                         "a chat template) write it at the end of the prompt")
    if not text:
        raise ValueError("--prefill-response is empty: drop it, or give the text the answer starts with")
    return list(tokenizer.encode(text, add_special_tokens=False))
