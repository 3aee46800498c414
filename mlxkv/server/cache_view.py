"""What one viewer may see of the block pool's picture (``GET /v1/cache/blocks``).

Every viewer sees each block's state (free / cached / in use / shared): the pool's counts are in
``/v1/cache/stats`` for every key already, and the map is the same figures laid out. Who holds a block, its
retention priority, hit count and text are shown only for the viewer's own blocks — those of prompts sent with the
viewer's cache salt (``?cache_salt=``; none: the unsalted prompts), since knowing the salt is what makes one the
tenant (tenancy.py) — unless the viewer sees the whole cache: a caller presenting the admin key, or, on a server
without an admin key, a caller presenting no key at all (the server has none: everyone is one principal). A caller
presenting an API key is a tenant: it never sees another tenant's text, whatever the server's other settings.
Cache salts themselves are never shown: another tenant appears as a short fingerprint of its salt to a
whole-cache viewer, as ``others`` to everyone else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable
from typing import Any

from fastapi import Request

from mlxkv.server.auth import key_matches, request_key
from mlxkv.server.tenancy import own_salt, request_tenant

#: The label of the unsalted prompts' blocks.
UNSALTED = "unsalted"
#: The label every block of another tenant gets in a tenant's view.
OTHERS = "others"


def tenant_label(salt: Hashable) -> str:
    """A tenant's public name: ``unsalted``, or ``t-`` and 8 hex digits of its salt's sha256."""
    if salt is None:
        return UNSALTED
    return "t-" + hashlib.sha256(str(salt).encode()).hexdigest()[:8]


def viewer(request: Request, cache_salt: str | None, admin_key: str | None) -> tuple[bool, Hashable]:
    """Whether ``request``'s caller sees the whole cache, and the salt its own prompts' blocks are keyed by."""
    token = request_key(request)
    return key_matches(token, admin_key) or (admin_key is None and not token), own_salt(request_tenant(request),
                                                                                         cache_salt)


def viewer_view(raw: dict[str, Any], *, sees_all: bool, scope: Hashable,
                decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """``raw`` (:func:`mlxkv.kv.blocks.block_map.block_map`) as the viewer may see it (see the module docstring).

    Args:
        raw: the engine's block map.
        sees_all: the viewer sees every tenant (labels, priorities, hits and text).
        scope: the salt of the viewer's own blocks (None: the unsalted prompts').
        decode: token ids to text.
    """
    salts = raw["tenants"]
    visible = [sees_all or salt == scope for salt in salts]
    if sees_all:
        tenants = [{"label": tenant_label(s), "own": s == scope} for s in salts]
        index = list(range(len(salts)))
    else:  # the viewer's own tenant (if it holds blocks) first, then one entry for all the others
        tenants, index = [], [-1] * len(salts)
        if scope in salts:
            tenants.append({"label": tenant_label(scope), "own": True})
            index[salts.index(scope)] = 0
        if not all(visible):
            others = len(tenants)
            tenants.append({"label": OTHERS, "own": False})
            index = [i if v else others for i, v in zip(index, visible)]
    owners = [index[o] if o >= 0 else -1 for o in raw["owners"]]
    priorities = [p if o >= 0 and visible[o] else None for o, p in zip(raw["owners"], raw["priorities"])]
    shown = {n["block"] for n in raw["tree"]["nodes"] if visible[n["owner"]]}
    nodes = [{"block": n["block"], "parent": n["parent"] if n["parent"] in shown else None, "depth": n["depth"],
              "tokens": len(n["tokens"]), "hits": n["hits"], "held": n["held"], "owner": index[n["owner"]],
              "text": decode(n["tokens"])}
             for n in raw["tree"]["nodes"] if n["block"] in shown]
    return {"view": "all" if sees_all else "tenant", "states": raw["states"], "owners": owners, "tenants": tenants,
            "priorities": priorities, "tree": {"nodes": nodes, "truncated": raw["tree"]["truncated"]}}
