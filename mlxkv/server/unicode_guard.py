"""Refuse request bodies holding invalid Unicode: a lone surrogate written as a JSON escape (``"\\ud800"``).

JSON allows ``\\uD800``-``\\uDFFF`` escapes, and Python's parser turns an unpaired one into a ``str`` that no UTF-8
consumer accepts: the tokenizer raises deep inside a route (a 500 that also drops the keep-alive connection), a
stop string can never match. One check before any route runs answers every such body with a 400 naming the field.
Raw invalid UTF-8 bytes never get this far (the body is then not JSON: a 400 already). Bodies without a surrogate
escape (nearly all) pay one byte search; the rest are parsed and their strings checked.
"""

from __future__ import annotations

import json
import re
from typing import Any

from fastapi import Request

from mlxkv.server.errors import APIError

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def lone_surrogate_path(obj: Any) -> str | None:
    """The dotted path of the first string (or key) in ``obj`` that is not valid Unicode; None if there is none.
    Iterative: a deeply nested body cannot exhaust the stack."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, x = stack.pop()
        if isinstance(x, str):
            if not x.isascii():
                try:
                    x.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
        elif isinstance(x, dict):
            for k, v in x.items():
                sub = f"{path}.{k}" if path else str(k)
                stack.append((sub, k))
                stack.append((sub, v))
        elif isinstance(x, list):
            stack.extend((f"{path}.{i}" if path else str(i), v) for i, v in enumerate(x))
    return None


async def reject_invalid_unicode(request: Request) -> None:
    """A FastAPI dependency: 400 ``invalid_unicode`` when the JSON body holds a lone surrogate anywhere."""
    if request.method not in ("POST", "PUT", "PATCH"):
        return
    body = await request.body()  # cached on the request: the route's own parsing reuses it
    if not _SURROGATE_ESCAPE.search(body):
        return
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return  # not JSON: the route's parsing answers 400
    path = lone_surrogate_path(obj)
    if path is not None:
        raise APIError(400, f"{path}: invalid Unicode (a lone surrogate escape such as \\ud800)", "invalid_unicode",
                       path)
