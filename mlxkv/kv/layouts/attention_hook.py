"""The attention hook: the one point where mlxkv plugs into mlx-lm's model code.

mlx-lm model modules do ``from .base import scaled_dot_product_attention`` and call
``scaled_dot_product_attention(q, k, v, cache=cache, scale=..., mask=..., sinks=...)`` after
``cache.update_and_fetch``. :func:`install_attention_hook` rebinds that name — in every module the
model's classes come from, and in ``mlx_lm.models.base`` — to a dispatcher that hands the call to
``cache.attend(...)`` when the cache has one (every mlxkv layout does) and to mlx-lm's original
function otherwise (mlx-lm caches, no cache, recurrent state). No mlx-lm model file is copied or
edited; models keep working with mlx-lm's own caches after the hook is installed.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models import base as mlx_base

_NAME = "scaled_dot_product_attention"
_ORIGINAL = getattr(mlx_base.scaled_dot_product_attention, "__wrapped__", mlx_base.scaled_dot_product_attention)


def dispatch_attention(queries: mx.array, keys: Any, values: Any, cache: Any, scale: float,
                       mask: Any | None, sinks: mx.array | None = None) -> mx.array:
    """mlx-lm's ``scaled_dot_product_attention`` signature; the cache decides how attention runs."""
    attend = getattr(cache, "attend", None)
    if attend is not None:
        return attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    return _ORIGINAL(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


dispatch_attention.__wrapped__ = _ORIGINAL  # type: ignore[attr-defined]
dispatch_attention.__mlxkv_hook__ = True  # type: ignore[attr-defined]


def model_modules(model: Any) -> list[str]:
    """Names of the Python modules that define the classes of ``model`` and its submodules."""
    names = {type(model).__module__}
    names.update(type(m).__module__ for _, m in model.named_modules())
    return sorted(names)


def install_attention_hook(model: Any) -> list[str]:
    """Route ``model``'s attention through ``cache.attend``. Idempotent; safe for every mlx-lm model.

    Returns:
        The modules whose ``scaled_dot_product_attention`` now points at the dispatcher (including
        ``mlx_lm.models.base`` and modules patched by an earlier call).
    """
    patched = []
    for name in ["mlx_lm.models.base", *model_modules(model)]:
        module = sys.modules.get(name)
        current = getattr(module, _NAME, None)
        if current is None:
            continue
        if current is _ORIGINAL:
            setattr(module, _NAME, dispatch_attention)
            current = dispatch_attention
        if current is dispatch_attention:
            patched.append(name)
    return patched


def uninstall_attention_hook(model: Any) -> None:
    """Restore mlx-lm's function in the modules :func:`install_attention_hook` patched (for tests)."""
    for name in ["mlx_lm.models.base", *model_modules(model)]:
        module = sys.modules.get(name)
        if getattr(module, _NAME, None) is dispatch_attention:
            setattr(module, _NAME, _ORIGINAL)
