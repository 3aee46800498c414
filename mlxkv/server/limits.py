"""Request limits that run before any route: as ASGI middleware, bodies over the size limit get 413 and bodies
slower than the read deadline 408 (:class:`BodySizeLimit`); as a body model, conversations with more messages than
the model's chat template can fit in its context get 400 before a message is validated (:func:`limit_messages`,
with :func:`template_cost` measuring what the template adds per message)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from pydantic import BaseModel, model_validator

from mlxkv.server.errors import APIError, error_body

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: Seconds a client may take to send a request's body (``mlxkv serve --body-timeout``): a client trickling its
#: body holds a connection and a worker's memory meanwhile.
DEFAULT_BODY_TIMEOUT_S = 60.0
#: Over-limit bodies up to this multiple of the limit are read and dropped before the 413, so the client (still
#: uploading) reliably sees the answer; larger ones are refused at once and the connection closed.
DRAIN_FACTOR = 4


class BodyTimeout(Exception):
    """The request body did not arrive within the deadline."""


class BodySizeLimit:
    """Answer 413 (in the error shape of the path's API) when a request body exceeds ``max_bytes``, and 408 when
    it is not whole within ``timeout_s`` seconds of the request's start (the connection is then closed).

    A declared ``Content-Length`` over the limit is refused without keeping the body (read and dropped up to
    ``DRAIN_FACTOR`` times the limit so the client sees the 413, else not read at all); otherwise (chunked
    uploads) the body is read up to the limit and replayed to the app, whose later ``receive`` calls go to
    the server again (so streaming responses still see client disconnects).
    """

    def __init__(self, app: Callable, max_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if not timeout_s > 0:
            raise ValueError(f"the body timeout must be > 0 seconds, got {timeout_s}")
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout_s

        async def timed() -> dict:
            left = deadline - asyncio.get_running_loop().time()
            try:
                return await asyncio.wait_for(receive(), max(left, 0.0))
            except asyncio.TimeoutError:
                raise BodyTimeout from None

        try:
            await self._limited(scope, timed, receive, send)
        except BodyTimeout:
            await self._answer(send, scope, 408, f"the request body did not arrive within {self.timeout_s:g} s",
                               "request_timeout")

    async def _limited(self, scope: Scope, timed: Receive, receive: Receive, send: Send) -> None:
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            if int(declared) <= DRAIN_FACTOR * self.max_bytes:
                await self._drain(timed)  # a client still uploading may miss a 413 sent mid-body
            await self._refuse(send, scope)
            return
        chunks, size = [], 0
        while True:
            message = await timed()
            if message["type"] != "http.request":
                break  # disconnected before the body was complete: let the app see it
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(send, scope)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    async def _drain(receive: Receive) -> None:
        """Read and drop the rest of the request body (bounded by the declared length the caller checked)."""
        while True:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                return

    async def _refuse(self, send: Send, scope: Scope) -> None:
        await self._answer(send, scope, 413, f"the request body is larger than {self.max_bytes} bytes",
                           "request_too_large")

    @staticmethod
    async def _answer(send: Send, scope: Scope, status: int, message: str, code: str) -> None:
        """An error in the path's API shape; the connection closes after it (the body was not read whole)."""
        body = json.dumps(error_body(status, message, code, path=scope.get("path", ""))).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


@dataclass(frozen=True, slots=True)
class TemplateCost:
    """What a model's chat template adds around each message, at the least (0: unknown).

    Attributes:
        tokens_per_message: tokens the template adds per message besides its content (its role markers).
        chars_per_message: characters it adds per message.
    """

    tokens_per_message: int = 0
    chars_per_message: int = 0


def template_cost(tokenizer: Any) -> TemplateCost:
    """Measure :class:`TemplateCost` by rendering one and three alternating one-character messages: what two more
    messages add, less their content. Token counts of rendered text are not additive when pieces merge across
    their boundaries, so one token per message is taken off (the role markers are special tokens on most models,
    which never merge). A template that refuses the probe costs 0 (unknown: no limit from it)."""
    if not getattr(tokenizer, "chat_template", None):
        return TemplateCost()
    one = [{"role": "user", "content": "x"}]
    three = one + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "x"}]
    try:
        texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in (one, three)]
        ids = [tokenizer.apply_chat_template(m, add_generation_prompt=True) for m in (one, three)]
    except Exception:  # noqa: BLE001 - templates raise anything; the content-only limits still hold
        return TemplateCost()
    content_tokens = len(tokenizer.encode("x", add_special_tokens=False)) if hasattr(tokenizer, "encode") else 1
    tokens = (len(ids[1]) - len(ids[0])) // 2 - content_tokens - 1
    chars = (len(texts[1]) - len(texts[0])) // 2 - 1
    return TemplateCost(max(tokens, 0), max(chars, 0))


def max_messages(context_length: int | None, cost: TemplateCost) -> int | None:
    """The most messages a conversation may have before its template alone overflows the context (every message
    taken as one token at least); None without a context."""
    if context_length is None:
        return None
    return max(1, context_length // max(1, cost.tokens_per_message))


def limit_messages(model: type[BaseModel], limit: int | None, context_length: int | None,
                   cost: TemplateCost) -> type[BaseModel]:
    """``model`` (a request body with a ``messages`` list) refusing more than ``limit`` messages before any of them
    is validated: counting costs nothing, validating and rendering 130,000 messages costs seconds of the event
    loop. The refusal is a 400 ``too_many_messages`` naming the limit (``limit`` None: ``model`` as it is)."""
    if limit is None:
        return model

    def count(cls: type, data: Any) -> Any:
        messages = data.get("messages") if isinstance(data, dict) else None
        if isinstance(messages, list) and len(messages) > limit:
            per = max(1, cost.tokens_per_message)
            raise APIError(400, f"the conversation has {len(messages)} messages: at most {limit} fit this model's "
                                f"{context_length}-token context (its chat template adds at least {per} token"
                                f"{'s' if per > 1 else ''} per message)", "too_many_messages", "messages")
        return data

    limited = type(model.__name__, (model,), {
        "__module__": model.__module__, "__doc__": model.__doc__,
        "_message_count": model_validator(mode="before")(classmethod(count))})
    return limited


def with_body(model: type[BaseModel]) -> Callable[[Callable], Callable]:
    """Decorator: the route's ``body`` parameter is validated as ``model`` (a class built at app creation, such as
    :func:`limit_messages`' — FastAPI reads a route's annotations, which name module-level classes only)."""

    def apply(route: Callable) -> Callable:
        route.__annotations__["body"] = model
        return route

    return apply
