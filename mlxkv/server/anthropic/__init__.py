"""The Anthropic Messages API over the batch engine (``/v1/messages``, ``/v1/messages/count_tokens``)."""

from mlxkv.server.anthropic.routes import anthropic_router

__all__ = ["anthropic_router"]
