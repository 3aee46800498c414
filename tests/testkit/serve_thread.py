"""An mlxkv app served in this process on a loopback port (uvicorn on a thread), and the official clients for it."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from mlxkv.config import RunConfig
from mlxkv.server.runner import ServerThread, build


@contextlib.contextmanager
def serve_in_thread(config: RunConfig, **build_options: Any) -> Iterator[ServerThread]:
    """``build(config, **build_options)`` served on a free port until the block ends. The server's
    :class:`~mlxkv.server.runner.ServerParts` are its ``parts`` (engine, loaded model, app)."""
    parts = build(config, **build_options)
    with ServerThread(parts.app) as srv:
        srv.parts = parts
        yield srv


def openai_client(url: str, api_key: str = "unused", timeout: float = 60):
    """The official ``openai`` client for the server at ``url`` (no retries: a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)


def anthropic_client(url: str, api_key: str = "unused", timeout: float = 60):
    """The official ``anthropic`` client for the server at ``url`` (no retries)."""
    import anthropic

    return anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=timeout)


@contextlib.contextmanager
def serve_models_in_thread(config: RunConfig, models: list[tuple[str, str]], **build_options: Any
                           ) -> Iterator[ServerThread]:
    """Several models (``(name, folder)`` pairs) behind one server, :func:`~mlxkv.server.runner.build_multi` with
    ``config``'s settings, served on a free port until the block ends; its ``registry`` holds the models."""
    from mlxkv.server.runner import build_multi

    parts = build_multi(config, models, **build_options)
    with ServerThread(parts.app) as srv:
        srv.registry = parts.registry
        yield srv
