"""The built-in web page: ``GET /`` and its assets under ``/ui/`` (``mlxkv serve --no-ui`` leaves them out).

The files ship in the package (mlxkv/server/ui/): plain HTML, JavaScript and CSS, no CDN, no build step. They hold
no data, so they are served to anyone; everything the page shows comes from the API routes (``/v1/cache/stats``,
``/v1/cache/blocks``, ``/v1/chat/completions``, ``/metrics``), behind the API key like any other client — on a
server with a key the page asks for it and sends it as ``Authorization: Bearer``. The Content-Security-Policy
keeps the page to this origin: no script, style or request goes anywhere else.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from mlxkv.server.errors import APIError

#: The files served, by name, with their content types.
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "plots.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
}


def _read(name: str) -> bytes:
    return resources.files("mlxkv.server").joinpath("ui", name).read_bytes()


def ui_router() -> APIRouter:
    """``GET /`` (the page) and ``GET /ui/{name}`` (its scripts and style)."""
    router = APIRouter(include_in_schema=False)

    @router.get("/")
    async def page() -> Response:
        return Response(_read("index.html"), media_type=ASSETS["index.html"], headers=_HEADERS)

    @router.get("/ui/{name}")
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            raise APIError(404, f"no file {name[:64]!r} in the page's assets", "not_found")
        return Response(_read(name), media_type=ASSETS[name], headers=_HEADERS)

    return router
