"""Where each chat message of a templated prompt ends, in tokens: the positions worth a recurrent-state snapshot.

A model with recurrent layers resumes a prefix hit only where a snapshot of their state exists. Requests that
share their first messages (one system prompt, many users; the earlier turns of a conversation) share the tokens
up to those messages' end, so the server marks those positions (``GenerationRequest.snapshot_at``) and the paged
backend snapshots at the last block boundary at or before each. A message's end is found by rendering the
template over the messages up to it (no generation prompt) and taking the common token prefix with the whole
prompt: the template's own rendering, whatever its markup, and never a position past what the prompt shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlxkv.chat.turns import common_prefix

#: Message ends looked for at most: the first ones (a system prompt) and the last ones (the latest turns).
MAX_MARKS = 16


def message_ends(tokenizer: Any, messages: list[dict[str, Any]], prompt: Sequence[int],
                 template_kwargs: dict[str, Any]) -> tuple[int, ...]:
    """Token positions in ``prompt`` where each message but the last ends (sorted, distinct, each > 0).

    Args:
        tokenizer: the tokenizer whose chat template rendered ``prompt``.
        messages: the request's messages (template form); template_kwargs: the variables ``prompt`` was
            rendered with.

    Returns:
        One position per message end the template renders as a prefix of the prompt; a template that refuses
        a partial conversation (one that must end with a user message, say) just contributes nothing there.
    """
    ks = list(range(1, len(messages)))
    if len(ks) > MAX_MARKS:
        ks = ks[: MAX_MARKS // 2] + ks[-MAX_MARKS // 2:]
    ends: set[int] = set()
    for k in ks:
        try:
            text = tokenizer.apply_chat_template(messages[:k], add_generation_prompt=False, tokenize=False,
                                                 **template_kwargs)
        except Exception:  # noqa: BLE001, S112 - templates raise anything on a partial conversation
            continue
        n = common_prefix(list(tokenizer.encode(text, add_special_tokens=False)), prompt)
        if 0 < n < len(prompt):
            ends.add(n)
    return tuple(sorted(ends))
