"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``, with a stored
response's conversation continued from the KV cache (``previous_response_id``; see :mod:`.store`)."""

from mlxkv.server.responses_api.routes import responses_router
from mlxkv.server.responses_api.store import ResponseStore, StoreConfig

__all__ = ["ResponseStore", "StoreConfig", "responses_router"]
