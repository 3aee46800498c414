"""Who a request is, and what it may ask of the shared cache.

**Tenants.** Every request carries an identity: the tenant its API key names. ``mlxkv serve --api-key KEY`` (given
several times) makes each key its own tenant; ``--api-keys-file FILE`` names the tenant of each key (several keys
may name one tenant; :func:`load_keys_file` says the format). A server whose keys name two tenants or more is
*multi-tenant*: every request's cache salt is derived from its tenant (:func:`cache_identity`), so no prompt's
cached blocks are reachable from another tenant, whatever the clients send. A client's own ``cache_salt`` narrows
within its tenant (two salts of one tenant share nothing either), never widens across tenants. A server with one
tenant — no key, a single ``--api-key``, or a keys file naming one tenant — shares its prefix cache between all its
clients as vLLM does: they are one principal, and a client isolates its prompts by sending ``cache_salt``.

**Sharing across tenants** is an explicit opt-in of both sides: ``cache_salt_ranges`` whose ranges cover the prompt
from token 0 without a gap form a *shared prefix*: its whole blocks are keyed by the ranges' salts only, so every
tenant sending the same tokens under the same range salts shares them (a common system prompt); the tenant's salt
keys everything after it (and always the prompt's last token and the generated text). On a one-tenant server the
ranges keep their plain meaning (tokens before the first range are unsalted).

**Retention and resets.**

- A request above the retention-priority cap (``mlxkv serve --max-client-priority``) is refused with a 400
  naming the cap, not clamped: a client that asked for 100 and silently got 50 would believe its prefix safe.
- ``POST /v1/cache/reset`` with a ``cache_salt`` drops only the cached blocks of prompts sent with that salt (by
  this tenant, on a multi-tenant server); without one it drops every tenant's, which a server started with
  ``--admin-key`` allows only to a caller presenting that key (403 otherwise). On a multi-tenant server a caller
  without the admin key resets its own tenant's default blocks (those of its prompts sent without a salt).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from mlxkv.server.errors import APIError

MAX_PRIORITY = 100
#: A tenant's name in a keys file: letters, digits and ``._@-``, 1-64 characters.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
#: An API key: printable ASCII without spaces (it travels in an HTTP header), 1-512 characters.
API_KEY = re.compile(r"[\x21-\x7e]{1,512}")
#: The tenant of the admin key when no keys-file entry names it (outside TENANT_NAME: no file can claim it).
ADMIN_TENANT = "(admin)"


@dataclass(frozen=True, slots=True)
class Tenant:
    """A request's identity.

    Attributes:
        name: the tenant's name (a keys-file name, ``key-<fingerprint>`` for a ``--api-key``, or ``(admin)``).
        isolated: its requests' cache salts derive from ``name`` (a multi-tenant server): see :func:`cache_identity`.
    """

    name: str
    isolated: bool = False


#: The one tenant of a server without keys, or whose keys all name one tenant.
SHARED = Tenant("default", isolated=False)


def key_fingerprint(key: str) -> str:
    """A ``--api-key``'s tenant name: ``key-`` and 12 hex digits of its sha256 (stable when keys are reordered)."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]


def load_keys_file(path: str | Path) -> dict[str, str]:
    """The keys of an ``--api-keys-file``: ``{key: tenant}``.

    Format: one ``TENANT: KEY`` per line (spaces around either are ignored); blank lines and lines starting with
    ``#`` are skipped. A tenant may have several keys (several lines); a key names one tenant.

    Raises:
        ValueError: one line naming the file, the line number and what is wrong (unreadable file, a line without
            ``:``, a bad tenant name or key, a key given twice, no key at all).
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--api-keys-file {path}: cannot read it: {getattr(exc, 'strerror', None) or exc}") from None
    keys: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"--api-keys-file {path}, line {number}"
        name, colon, key = (part.strip() for part in line.partition(":"))
        if not colon:
            raise ValueError(f"{where}: expected 'TENANT: KEY'")
        if not TENANT_NAME.fullmatch(name):
            raise ValueError(f"{where}: the tenant name must be 1-64 letters, digits or ._@- (starting with a letter "
                             f"or digit), got {name[:70]!r}")
        if not API_KEY.fullmatch(key):
            raise ValueError(f"{where}: the key must be 1-512 printable ASCII characters without spaces")
        if key in keys:
            raise ValueError(f"{where}: this key is already given (line for tenant {keys[key]!r}): a key names one "
                             "tenant")
        keys[key] = name
    if not keys:
        raise ValueError(f"--api-keys-file {path}: no 'TENANT: KEY' line in it")
    return keys


class Tenants:
    """The server's API keys and the tenant each names (see the module docstring).

    Args:
        keys: ``{key: tenant name}`` (empty: an open server, one tenant).
        admin_key: the admin key, accepted wherever an API key is; its tenant is the one ``keys`` gives it, else
            :data:`ADMIN_TENANT`.

    Raises:
        ValueError: an empty key or tenant name.
    """

    def __init__(self, keys: Mapping[str, str] | None = None, admin_key: str | None = None):
        keys = dict(keys or {})
        if any(not k or not n for k, n in keys.items()):
            raise ValueError("API keys and tenant names must not be empty")
        names = set(keys.values())
        #: whether requests' cache salts derive from their tenants (two tenants or more among the API keys)
        self.multi = len(names) >= 2
        #: whether requests must present a key (the server has API keys; an admin key alone opens no route)
        self.required = bool(keys)
        self._keys = [(k.encode(), Tenant(n, self.multi)) for k, n in keys.items()]
        if admin_key and admin_key not in keys:
            self._keys.append((admin_key.encode(), Tenant(ADMIN_TENANT, self.multi)))
        self.admin_key = admin_key or None

    @classmethod
    def from_options(cls, api_keys: Iterable[str] = (), keys_file: str | Path | None = None,
                     admin_key: str | None = None) -> "Tenants":
        """``mlxkv serve``'s keys: each ``--api-key`` its own tenant (named by :func:`key_fingerprint`), and the
        tenants of ``--api-keys-file``.

        Raises:
            ValueError: one line: a bad keys file (:func:`load_keys_file`), a bad key, a key given twice.
        """
        keys = load_keys_file(keys_file) if keys_file is not None else {}
        for key in api_keys:
            if not API_KEY.fullmatch(key):
                raise ValueError("--api-key: a key must be 1-512 printable ASCII characters without spaces")
            if key in keys:
                raise ValueError(f"--api-key: a key is given twice (its tenant: {keys[key]!r})")
            keys[key] = key_fingerprint(key)
        return cls(keys, admin_key)

    @property
    def keys(self) -> list[str]:
        """Every key a request must present one of (the admin key among them); none on an open server."""
        return [k.decode() for k, _ in self._keys] if self.required else []

    def resolve(self, token: str) -> Tenant | None:
        """The tenant of ``token`` (None: no key matches). Every key is compared, in constant time each, so the
        time taken tells nothing of which key was closest."""
        found = None
        raw = token.encode()
        for key, tenant in self._keys:
            if hmac.compare_digest(raw, key) and found is None:
                found = tenant
        return found if token else None


def request_tenant(request: Request) -> Tenant:
    """The tenant the API-key check found for ``request`` (:data:`SHARED` on an open server)."""
    return getattr(request.state, "tenant", None) or SHARED


def own_salt(tenant: Tenant, cache_salt: str | None) -> str | None:
    """The cache salt of ``tenant``'s request sent with ``cache_salt``: on a multi-tenant server derived from
    both (distinct for every pair; no client-sent salt can equal one), else ``cache_salt`` as sent."""
    if not tenant.isolated:
        return cache_salt
    return json.dumps(["mlxkv-tenant", tenant.name, cache_salt])


def _shared_salt(salt: str) -> str:
    """A cross-tenant range's salt on a multi-tenant server: never equal to a tenant's (:func:`own_salt`)."""
    return json.dumps(["mlxkv-shared", salt])


def cache_identity(tenant: Tenant, cache_salt: str | None, ranges: tuple[tuple[int, int, str], ...],
                   prompt_length: int) -> tuple[str | None, tuple[tuple[int, int, str], ...]]:
    """The engine's ``(cache_salt, cache_salt_ranges)`` for ``tenant``'s request (see the module docstring).

    One tenant: as sent. Multi-tenant: without ranges covering the prompt from token 0, the tenant's salt
    (:func:`own_salt`) keys the first block, hence the whole chain; with them, the shared prefix (the ranges
    from 0 without a gap, never the last prompt token) is keyed by the ranges' salts, and the tenant's salt keys
    every block from the prefix's end on — including the generated ones.
    """
    if not tenant.isolated:
        return cache_salt, ranges
    own = own_salt(tenant, cache_salt)
    shared = tuple((s, e, _shared_salt(k)) for s, e, k in ranges)
    prefix = 0
    for start, end, _ in sorted(ranges):
        if start > prefix:
            break
        prefix = max(prefix, end)
    prefix = min(prefix, prompt_length - 1)
    if prefix <= 0:
        return own, shared
    return None, shared + ((prefix, 2**62, own),)


def check_max_client_priority(cap: int) -> int:
    """``cap`` if it is a priority in 0..100.

    Raises:
        ValueError: out of range.
    """
    if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= MAX_PRIORITY:
        raise ValueError(f"max_client_priority={cap!r}: expected an integer in 0..{MAX_PRIORITY}")
    return cap


def check_retention(retention: Any, cap: int) -> None:
    """Refuse a request's ``retention`` (schemas.RetentionBody or None) asking above ``cap``: only the priorities
    the request sets count (an unset ``decode_priority`` takes the server's default).

    Raises:
        APIError: 400 ``priority_above_cap`` naming the field and the cap.
    """
    if retention is None or cap >= MAX_PRIORITY:
        return
    asked = [(f"retention.token_ranges.{i}.priority", r.priority) for i, r in enumerate(retention.token_ranges)]
    if "decode_priority" in retention.model_fields_set:
        asked.append(("retention.decode_priority", retention.decode_priority))
    for field, priority in asked:
        if priority > cap:
            raise APIError(400, f"{field}: retention priority {priority} is above this server's cap of {cap} "
                                f"(--max-client-priority)", "priority_above_cap", field)


class CacheResetRequest(BaseModel):
    """``POST /v1/cache/reset`` body (optional): ``cache_salt`` limits the reset to that tenant's blocks."""

    model_config = ConfigDict(extra="forbid")
    cache_salt: Optional[str] = Field(None, min_length=1, max_length=256,
                                      description="reset only the blocks of prompts sent with this salt")


def reset_scope(body: CacheResetRequest | None, request: Request, admin_key: str | None, admin: bool) -> str | None:
    """The cache salt a reset is limited to, or None for every tenant — which, on a server with an admin key,
    only the admin key may ask for; on a multi-tenant server without the admin key, a reset without a salt is
    limited to the caller's tenant's unsalted prompts. ``admin``: the request presents the admin key.

    Raises:
        APIError: 403 ``admin_key_required`` for a reset of every tenant without the admin key.
    """
    tenant = request_tenant(request)
    if body is not None and body.cache_salt is not None:
        return own_salt(tenant, body.cache_salt)
    if admin:
        return None
    if tenant.isolated:
        return own_salt(tenant, None)
    if admin_key is not None:
        raise APIError(403, "resetting every tenant's cache needs the admin key; send cache_salt to reset the "
                            "blocks of your own prompts", "admin_key_required", "cache_salt")
    return None
