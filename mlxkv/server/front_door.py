"""The middleware in front of every mlxkv app (one model or several): what a request meets before any route."""

from __future__ import annotations

from typing import Sequence

from fastapi import FastAPI

from mlxkv.server.auth import OPERATOR_PATHS, KeyProtectedPaths
from mlxkv.server.compat import install_cors
from mlxkv.server.limits import BodySizeLimit
from mlxkv.server.tenancy import Tenants


def install_front_door(app: FastAPI, *, tenants: Tenants, max_body_bytes: int, body_timeout_s: float,
                       metrics_key: str | None, public_metrics: bool, allowed_origins: Sequence[str] | None) -> None:
    """Add the body-size limit, the operator keys on the operator paths and CORS to ``app``.

    Starlette runs the middleware added last first, so a request meets CORS, then the operator keys, then the
    body limit, then whatever the caller added before (several models: the dispatch to a model's app).
    """
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes, timeout_s=body_timeout_s)
    operator_keys = tenants.keys + ([metrics_key] if metrics_key else [])
    if operator_keys:
        paths = OPERATOR_PATHS - {"/metrics"} if public_metrics else OPERATOR_PATHS
        app.add_middleware(KeyProtectedPaths, keys=operator_keys, paths=paths)
    install_cors(app, allowed_origins)
