"""What browsers and OpenAI clients expect beside the routes: CORS, a ``system_fingerprint``, SSE keep-alives."""

from __future__ import annotations

import hashlib
import importlib.metadata
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from fastapi import FastAPI

#: An SSE comment line: clients and proxies see traffic; OpenAI's client (and any SSE parser) skips it.
KEEPALIVE_EVENT = ": keep-alive\n\n"
#: Seconds a stream may stay silent (a long prefill, a wait for admission) before a keep-alive comment.
DEFAULT_KEEPALIVE_S = 10.0


def parse_origins(values: Sequence[str] | None) -> list[str]:
    """``--allowed-origins`` values (each may be a comma-separated list) as one list; ``*`` allows any origin.

    Raises:
        ValueError: an origin that is not ``*`` nor ``scheme://host[:port]``.
    """
    origins = [o.strip().rstrip("/") for v in values or () for o in v.split(",") if o.strip()]
    for o in origins:
        if o != "*" and ("://" not in o or o.split("://", 1)[1] in ("", "*")):
            raise ValueError(f"{o!r} is not an origin: expected '*' or scheme://host[:port], e.g. http://localhost:3000")
    return origins


def install_cors(app: "FastAPI", origins: Sequence[str]) -> None:
    """Answer CORS preflights and add CORS headers for ``origins`` (none: no CORS at all, browsers refuse).

    Added last, so it wraps every other layer: preflights are answered before authentication (browsers send
    them without credentials), and errors (401, 413) carry the headers a browser needs to read them.
    """
    if not origins:
        return
    from starlette.middleware.cors import CORSMiddleware

    # No credentials mode: a bearer token is an ordinary header (allowed), cookies are not used.
    app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"], allow_headers=["*"],
                       max_age=600)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def system_fingerprint(model_name: str, tokenizer: Any, model: Any = None) -> str:
    """OpenAI's ``system_fingerprint``: ``fp_`` and 10 hex digits that change when what shapes the answers does
    (mlxkv, MLX and mlx-lm versions, the model's name, its chat template and tool parser, and what else the
    model's identity holds, e.g. a LoRA adapter's digest)."""
    from mlxkv.adapters import model_identity

    template = getattr(tokenizer, "chat_template", None)
    parser = getattr(getattr(tokenizer, "tool_parser", None), "__module__", None)
    extra = model_identity(model)
    parts = [_version("mlxkv"), _version("mlx"), _version("mlx-lm"), model_name, str(template), str(parser)]
    if extra is not None:
        parts.append(str(extra))
    return "fp_" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:10]
