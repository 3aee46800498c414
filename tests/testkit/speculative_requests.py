"""Completions against a speculating server through the openai client: one request, several at once, their texts
and the ``usage.speculative`` counts."""

from __future__ import annotations

import concurrent.futures


def complete(client, prompt, **kw):
    """One greedy completion of 40 tokens unless ``kw`` says otherwise."""
    kw.setdefault("max_tokens", 40)
    kw.setdefault("temperature", 0)
    return client.completions.create(model="m", prompt=prompt, **kw)


def texts(response):
    """The choices' texts in index order."""
    return [c.text for c in sorted(response.choices, key=lambda c: c.index)]


def together(client, prompts, **kw):
    """The prompts as concurrent requests (one engine step verifies them together)."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(client, p, **kw), prompts))


def speculative_usage(response):
    """The response's ``usage.speculative`` extension (None without speculation)."""
    return (response.usage.model_extra or {}).get("speculative")
