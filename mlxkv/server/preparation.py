"""One request preparation for every API shape: from a route's translated request to the queued engine request.

A route (``/v1/chat/completions``, ``/v1/completions``, ``/v1/messages``, and any added later) only translates its
API's shape: in, a :class:`PromptSource` (a conversation, a text or token ids) and a :class:`Constraint` (its
``response_format`` and tools, in OpenAI's chat form); out, the events rendered as its API answers them.
:meth:`Preparation.prepare` does the rest, in this order, the same way for every route:

0. **sizes**: the body's size-like fields against the model and its context (:mod:`mlxkv.server.admission`);
1. **limits**: a prompt whose characters (with what the chat template adds per message) cannot fit the context is
   refused before it is tokenized (a conversation with too many messages never gets here:
   :func:`mlxkv.server.limits.limit_messages`);
2. **constraint**: the grammar its choices follow (:mod:`mlxkv.server.structured_output`), built on the tokenizer
   lane;
3. **tokenizing** (:mod:`mlxkv.server.tokenizing`: a short prompt on the event loop, a long one on the worker),
   or the token ids checked against the vocabulary; an empty prompt is refused;
4. **message ends**: the positions worth a recurrent-state snapshot (:mod:`mlxkv.server.message_ends`), when the
   KV store takes them;
5. **overflow policy**: the request's ``kv_overflow`` (:mod:`mlxkv.server.kv_overflow`), checked against the
   pool's facts captured when the engine was built (:class:`mlxkv.engine.pool_facts.PoolFacts`);
6. **cache fields** (:class:`mlxkv.server.schemas.CacheFields`: ``cache_salt``, ``cache_salt_ranges``,
   ``retention``, ``priority``): the retention cap checked, the salts derived from the request's tenant
   (:func:`mlxkv.server.tenancy.cache_identity`) — on every route, so no route can leave a prompt unsalted; and
   ``speculative`` (this request's draft length, refused on a server that does not draft).

The result, a :class:`Prepared`, becomes the engine request with the route's own fields (sampling, ``n``)
in :meth:`Preparation.submit`. Nothing here touches the engine's pool: the engine thread owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from mlxkv.engine.batch import BatchEngine
from mlxkv.engine.request import GenerationRequest, RequestHandle
from mlxkv.engine.sampling import SamplingParams
from mlxkv.config import KvOverflowConfig
from mlxkv.server.admission import check_sizes
from mlxkv.server.errors import APIError
from mlxkv.server.generation import submit
from mlxkv.server.kv_overflow import KvOverflowBody, request_overflow
from mlxkv.server.limits import TemplateCost
from mlxkv.server.message_ends import message_ends
from mlxkv.server.openai_fields import cache_key_span
from mlxkv.server.prompts import PromptEncoder
from mlxkv.server.schemas import CacheFields, draft_tokens_of
from mlxkv.server.structured_output import needs_grammar, output_format, parse_format
from mlxkv.server.tenancy import Tenant, cache_identity, check_retention
from mlxkv.server.tokenizing import TokenizerLanes, content_chars
from mlxkv.server.tools import ToolRequestError
from mlxkv.structured import ResponseFormat


def tool_error(exc: ToolRequestError) -> APIError:
    """A tool refusal as the OpenAI routes name it (the request's own field names)."""
    return APIError(400, exc.message, exc.code, exc.param)


@dataclass(slots=True)
class PromptSource:
    """A request's prompt as its route translated it: ``messages`` (chat, template form), else ``text``, else
    ``token_ids``.

    Attributes:
        messages: chat messages as the template reads them.
        template_kwargs: the template's variables (the rendered tools among them).
        continue_final: the last message is an assistant turn the answer continues (rendered whole, without its
            end and without a generation prompt).
        text: a completion prompt.
        token_ids: a completion prompt already tokenized.
        param: the request field a problem with the prompt is blamed on.
        images: the images taken out of ``messages`` (:class:`mlxkv.vision.inputs.RequestImages`), if any.
    """

    messages: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    continue_final: bool = False
    text: str | None = None
    token_ids: list[int] | None = None
    param: str = "messages"
    images: Any = None  # mlxkv.vision.inputs.RequestImages: the messages' images, each a marker in their text


@dataclass(slots=True)
class Constraint:
    """What constrains a request's output, in OpenAI's chat form.

    Attributes:
        fmt: the request's ``response_format`` (:func:`~mlxkv.server.structured_output.parse_format`; text: free).
        tools: the tools in use (``None``: none, or ``tool_choice`` none).
        tool_choice: as OpenAI's chat route reads it (``"auto"``, ``"required"``, a named function).
        parallel: ``parallel_tool_calls`` (false: at most one call).
        tool_error: a tool refusal in the route's field names.
    """

    fmt: ResponseFormat = field(default_factory=lambda: parse_format(None))
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel: bool = True
    tool_error: Callable[[ToolRequestError], APIError] = tool_error


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready for the engine, whatever API it came through.

    Attributes:
        prompt: the prompt's token ids.
        grammar: the grammar every choice follows (``None``: free).
        snapshot_at: message ends worth a recurrent-state snapshot.
        overflow: the request's own ``kv_overflow`` policy (``None``: the server's).
        param: the request field an over-long prompt is blamed on.
        cache: the engine request's cache fields (``cache_salt`` and ``cache_salt_ranges`` as the tenant's,
            ``retention``, ``priority``).
        media: the prompt's images (:class:`mlxkv.vision.spans.ImageSpan`).
    """

    prompt: list[int]
    grammar: ResponseFormat | None = None
    snapshot_at: tuple[int, ...] = ()
    overflow: KvOverflowConfig | None = None
    param: str = "messages"
    cache: dict[str, Any] = field(default_factory=dict)
    media: tuple = ()

    def request(self, params: SamplingParams, **fields: Any) -> GenerationRequest:
        """The engine request: these parts, ``params`` and the route's own ``fields`` (``n``, logprobs; a route
        that manages retention itself gives ``retention``, which replaces the body's).

        Raises:
            ValueError: settings the request refuses.
        """
        return GenerationRequest(self.prompt, params, response_format=self.grammar, snapshot_at=self.snapshot_at,
                                 kv_overflow=self.overflow, media=self.media, **{**self.cache, **fields})


class Preparation:
    """The server's one request preparation (see the module docstring).

    Args:
        engine: the batch engine (its tokenizer, context, vocabulary and pool facts; it queues the requests).
        prompts: the app's prompt encoder (a long shared system prompt is tokenized once for every route).
        lanes: the app's tokenizing lanes.
        vocab: the vocabulary size token-id prompts are checked against (``None``: unchecked).
        max_client_priority: the highest retention priority a request may ask for (``--max-client-priority``).
        cost: what the chat template adds per message (:func:`mlxkv.server.limits.template_cost`), counted with
            the messages' characters before rendering.
    """

    def __init__(self, engine: BatchEngine, prompts: PromptEncoder, lanes: TokenizerLanes, vocab: int | None,
                 max_client_priority: int = 100, cost: TemplateCost | None = None, vision: Any = None):
        self.vision = vision  # mlxkv.vision.inputs.VisionInputs, or None: the model's image support
        self.max_client_priority = max_client_priority
        self.cost = cost or TemplateCost()
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.prompts = prompts
        self.lanes = lanes
        self.vocab = vocab
        self.facts = engine.pool_facts

    async def prepare(self, source: PromptSource, constraint: Constraint | None = None,
                      kv_overflow: KvOverflowBody | None = None, *, tenant: Tenant,
                      body: CacheFields | None = None) -> Prepared:
        """The request's prompt, grammar, message ends, overflow policy and cache fields, for ``tenant``
        (:func:`mlxkv.server.tenancy.request_tenant`); ``body``: the request body, whose cache fields apply and
        whose size-like fields are checked against the model first (:func:`mlxkv.server.admission.check_sizes`).

        Raises:
            APIError: 400 for a prompt too long by its characters, a refused constraint, a template that rejects
                the messages, token ids outside the vocabulary, an empty prompt, an invalid ``kv_overflow``, a
                retention priority above the cap, a size-like field beyond the model.
        """
        cache = body or CacheFields()
        draft_tokens_of(cache.speculative, self.engine.speculation is not None)  # refused before any work
        check_sizes(cache, context_length=self.engine.context_length, vocab_size=self.vocab)
        check_retention(cache.retention, self.max_client_priority)
        self.check_chars(source)
        grammar = await self.grammar(constraint) if constraint is not None else None
        prompt = await self.tokens(source, checked=True)
        media: tuple = ()
        if source.images:
            prompt, media = await self.images(source, prompt)
        ends = await self.message_ends(source, prompt) if not media else ()
        overflow = request_overflow(kv_overflow, self.facts)
        salt, ranges = cache_identity(tenant, cache.cache_salt, cache.salt_ranges(len(prompt)), len(prompt))
        # a prompt_cache_key narrows sharing within what the tenant's salts allow, never widens it
        ranges += cache_key_span(getattr(body, "prompt_cache_key", None), len(prompt))
        fields = {"cache_salt": salt, "cache_salt_ranges": ranges, "priority": cache.priority,
                  "retention": cache.retention.to_spec() if cache.retention else None,
                  "num_draft_tokens": draft_tokens_of(cache.speculative, self.engine.speculation is not None)}
        return Prepared(prompt, grammar, ends, overflow, source.param, fields, media)

    async def images(self, source: PromptSource, prompt: list[int]) -> tuple[list[int], tuple]:
        """The prompt with its images' placeholder tokens, and their spans (the image processor on the worker).

        Raises:
            APIError: 400 when the model takes no images or the prompt's image markers do not match the images.
        """
        from mlxkv.vision.images import ImageError
        from mlxkv.vision.support import TEXT_ONLY, VisionUnavailable

        try:
            if self.vision is None:
                raise VisionUnavailable(TEXT_ONLY)
            return await self.lanes.on_worker(lambda: self.vision.expand(prompt, source.images))
        except (ImageError, VisionUnavailable) as exc:
            raise APIError(400, str(exc), "invalid_image", source.param) from None

    def check_chars(self, source: PromptSource) -> None:
        """Refuse a prompt whose characters alone cannot fit the context (400 ``context_length_exceeded``): for a
        conversation, its content and what the template adds around each message."""
        if source.messages is not None:
            chars = content_chars(source.messages) + len(source.messages) * self.cost.chars_per_message
        elif source.text is not None:
            chars = len(source.text)
        else:
            return
        problem = self.lanes.check_chars(chars)
        if problem is not None:
            raise APIError(400, problem, "context_length_exceeded", source.param)

    async def tokens(self, source: PromptSource, *, checked: bool = False) -> list[int]:
        """The prompt's token ids (``checked``: :meth:`check_chars` already ran).

        Raises:
            APIError: 400 as :meth:`prepare` says for the prompt.
        """
        if not checked:
            self.check_chars(source)
        if source.messages is not None:
            ids = await self._chat(source)
        elif source.text is not None:
            text = source.text
            ids = await self.lanes.tokenize(lambda: self.prompts.encode_if_cheap(text),
                                            lambda: list(self.tokenizer.encode(text)))
        else:
            ids = list(source.token_ids or ())
            if self.vocab is not None and any(not 0 <= t < self.vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {self.vocab})", "invalid_value", source.param)
        if not ids:
            raise APIError(400, "the prompt is empty", "invalid_value", "prompt")
        return ids

    async def _chat(self, source: PromptSource) -> list[int]:
        messages, template = source.messages, source.template_kwargs
        try:
            if source.continue_final:  # rendered whole: the memo's head/tail split assumes a generation prompt
                return await self.lanes.on_worker(lambda: list(self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=False, continue_final_message=True, **template)))
            return await self.lanes.tokenize(lambda: self.prompts.chat_if_cheap(messages, **template),
                                             lambda: self.prompts.chat(messages, **template))
        except Exception as exc:  # noqa: BLE001 - templates raise anything (jinja errors, bad roles)
            raise APIError(400, f"the chat template rejected the messages: {exc}", "invalid_messages") from None

    async def grammar(self, constraint: Constraint) -> ResponseFormat | None:
        """The grammar the request's choices follow (``None``: free), built on the tokenizer lane: it encodes the
        tool-call markers and, at the server's first constrained request, builds the grammar vocabulary."""
        c = constraint
        if not needs_grammar(c.fmt, c.tools, c.tool_choice):
            return None
        try:
            return await self.lanes.on_worker(lambda: output_format(self.tokenizer, c.fmt, c.tools, c.tool_choice,
                                                                    parallel=c.parallel))
        except ToolRequestError as exc:
            raise c.tool_error(exc) from None

    async def message_ends(self, source: PromptSource, prompt: list[int]) -> tuple[int, ...]:
        """Where each message but the last ends in ``prompt``, when the KV store snapshots there (else none)."""
        messages = source.messages
        if messages is None or len(messages) < 2 or not self.facts.state_snapshots:
            return ()
        return await self.lanes.on_worker(lambda: message_ends(self.tokenizer, messages, prompt,
                                                               source.template_kwargs))

    def submit(self, prepared: Prepared, build: Callable[[Prepared], GenerationRequest]) -> RequestHandle:
        """Queue ``build(prepared)`` on the engine (see :func:`mlxkv.server.generation.submit` for the errors)."""
        return submit(self.engine, lambda: build(prepared), prompt_param=prepared.param)
