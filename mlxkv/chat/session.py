"""ChatSession: a conversation whose KV cache lives from one turn to the next.

Each turn renders the whole conversation with the chat template, reuses the longest common token prefix with what
the cache holds (:mod:`mlxkv.chat.turns`) and prefills only the rest, then decodes the answer into the same cache.
The conversation's cache is one sequence of a one-sequence dense :class:`~mlxkv.kv.CachePool`, kept open from turn
to turn; each turn is a request of a :class:`~mlxkv.engine.direct.DirectEngine` that continues that sequence, so a
turn runs the engine step ``mlxkv generate`` and ``mlxkv serve`` run (prefill chunks, row samplers, decode loop).

Long conversations: the context is capped at the model's limit (``max_position_embeddings``) or ``max_kv_size``
when that is smaller. A turn whose prompt and answer would not fit drops whole turns from the front (the system
message stays) and re-prefills what follows the system message; the caches are always full-attention caches, so
the model attends to every token it keeps and the conversation it sees is one the template could have rendered.
A single message too long for the context is refused (``ValueError``); an answer is cut where the context ends.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from mlxkv.chat.turns import Message, fit_conversation, plan_turn
from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.output import TextStream
from mlxkv.engine.prefill import PrefillStopped
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv import CachePool, RewindError, each_layer_cache


@dataclass
class TurnStats:
    """Figures of the last turn, for ``/stats``."""

    prompt_tokens: int = 0  # the whole rendered conversation
    cached_tokens: int = 0  # of those, reused from the cache (the engine's count: its prefill started there)
    prefill_tokens: int = 0  # of those, run through the model this turn
    prefill_seconds: float = 0.0
    generation_tokens: int = 0
    generation_seconds: float = 0.0  # first token to last (the first token's time is in prefill_seconds)
    dropped_turns: int = 0  # turns dropped from the front to make room
    drafted_tokens: int = 0  # speculative decoding: tokens proposed
    accepted_tokens: int = 0  # of those, verified and kept
    decode_forwards: int = 0  # decode forwards run (with speculation, fewer than the tokens after the first)
    finish_reason: str | None = None  # "stop" (EOS, stop string), "length" (max tokens or the context), "interrupted"

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        # Tokens after the first over the time after the first token (the first came with the prefill).
        n = self.generation_tokens - 1
        return n / self.generation_seconds if n > 0 and self.generation_seconds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0 when nothing was proposed)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_forward(self) -> float:
        """Tokens after the first per decode forward (1.0 without speculation)."""
        n = self.generation_tokens - 1
        return n / self.decode_forwards if n > 0 and self.decode_forwards else 0.0


class ChatSession:
    """One conversation with a model, its messages and the KV cache of their tokens.

    Args:
        model: the mlx-lm model (``mlxkv.models.load``'s, attention hook installed).
        tokenizer: mlx-lm's ``TokenizerWrapper``; it must have a chat template.
        system: the system message, if any.
        max_kv_size: most tokens of context (``None``: the model's limit only).
        model_limit: the model's context length (``None``: unknown, only ``max_kv_size`` applies).
        kv_bits, kv_group_size: quantized K/V (see :func:`mlxkv.kv.make_caches`).
        prefill_step_size: prompt tokens per prefill forward.
        overflow: a :class:`mlxkv.config.KvOverflowConfig`: the per-sequence budget policy of full-attention layers
            (see :func:`mlxkv.kv.make_caches`); the context may then outgrow the budget up to the model's limit.
        template_kwargs: extra chat template variables for every rendering (e.g. ``{"enable_thinking": False}``).
        speculation: speculative decoding on the engine step (:class:`~mlxkv.engine.speculation.Speculation`;
            None: off): each turn proposes tokens by prompt lookup over the whole conversation rendered so far and
            the answer's own, or from a draft model (whose own paged pool keeps earlier turns as a prefix cache),
            and verifies them on the step (the same greedy answers).

    Raises:
        ValueError: no chat template, or a bad cache option (a quantization group that does not divide head_dim);
            ``speculation`` over caches it cannot rewind (an overflow policy, sliding-window or recurrent layers).
    """

    def __init__(self, model: Any, tokenizer: Any, *, system: str | None = None, max_kv_size: int | None = None,
                 model_limit: int | None = None, kv_bits: int | None = None, kv_group_size: int = 64,
                 prefill_step_size: int = 2048, overflow: Any = None, template_kwargs: dict | None = None,
                 speculation: Any = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: chat needs one (--chat-template FILE)")
        if max_kv_size is not None and max_kv_size < 2:
            raise ValueError(f"max_kv_size must be >= 2, got {max_kv_size}")
        self.model = model
        self.tokenizer = tokenizer
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size
        self.overflow = overflow
        self.template_kwargs = dict(template_kwargs or {})
        limits = [n for n in (max_kv_size, model_limit) if n]
        self.limit = min(limits) if limits else None
        self.prefill_step_size = prefill_step_size
        # Full-attention layouts (no max_kv_size): the length cap is enforced by dropping turns, see module doc. The
        # pool checks the cache options now (a quantization group that does not divide head_dim), not at a message.
        pool = CachePool(model, max_sequences=1, kv_bits=kv_bits, kv_group_size=kv_group_size, overflow=overflow)
        self.engine = DirectEngine(model, tokenizer, pool=pool, prefill_step_size=prefill_step_size,
                                   speculation=speculation)
        self.messages: list[Message] = []
        self.tokens: list[int] = []  # the tokens whose K/V the caches hold, in order
        self.sequence = pool.open()  # the conversation's cache, continued by every turn
        self.pending_images: list = []  # attached (/image) to the next user message: mlxkv.vision PreparedImage
        self._images: dict[int, tuple[Message, tuple]] = {}  # id(user message) -> (it, its images)
        self._vision: Any = None  # the encoder of the images (mlxkv.vision.encoder.ImageEncoder)
        self.last = TurnStats()
        self.reset(system)

    # -- conversation state ---------------------------------------------------------------------------------
    def reset(self, system: str | None = None) -> None:
        """Start a new conversation (with ``system`` as its system message); the cache is emptied (its buffers
        stay allocated for the next turn)."""
        self.messages = [{"role": "system", "content": system}] if system else []
        self.pending_images, self._images = [], {}
        self._trim_to(0)

    @property
    def system(self) -> str | None:
        """The system message of the conversation, if any."""
        first = self.messages[0] if self.messages else None
        return first["content"] if first and first["role"] == "system" else None

    def set_system(self, text: str | None) -> None:
        """Replace (or with ``None``/empty remove) the system message, keeping the rest of the conversation."""
        rest = self.messages[1:] if self.system is not None else self.messages
        self.messages = ([{"role": "system", "content": text}] if text else []) + rest

    def restore(self, messages: list[Message], tokens: list[int], caches: list) -> None:
        """Take over a saved conversation: its messages, and caches holding exactly ``tokens``.

        Raises:
            ValueError: the caches are not this model's number of layers or do not hold ``len(tokens)`` tokens.
        """
        if len(caches) != len(self.caches):
            raise ValueError(f"the saved cache has {len(caches)} layers, this model {len(self.caches)}")
        offsets = {getattr(c, "offset", len(tokens)) for c in each_layer_cache(caches)}
        if offsets != {len(tokens)}:
            raise ValueError(f"the saved cache holds {sorted(offsets)} tokens per layer, its record {len(tokens)}")
        # A dense sequence's layer caches are its storage: the restored ones take their place.
        self.messages, self.tokens, self.sequence.caches = [dict(m) for m in messages], list(tokens), caches

    @property
    def caches(self) -> list:
        """The conversation's layer caches (those of its sequence), one per model layer."""
        return self.sequence.caches

    @property
    def context_tokens(self) -> int:
        """Tokens the KV cache holds."""
        return len(self.tokens)

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV cache's buffers."""
        return sum(int(getattr(c, "nbytes", 0) or 0) for c in each_layer_cache(self.caches))

    def render(self, messages: Sequence[Message]) -> list[int]:
        """The prompt tokens of ``messages`` (the template's rendering, with the generation prompt; each image's
        marker followed by its placeholder tokens)."""
        return self._prompt(messages)[0]

    def _prompt(self, messages: Sequence[Message]) -> tuple[list[int], tuple]:
        """The prompt tokens of ``messages`` and the spans of the images they hold."""
        ids = list(self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                      **self.template_kwargs))
        images = [image for m in messages for image in self._images.get(id(m), (None, ()))[1]]
        if not images:
            return ids, ()
        from mlxkv.vision.prompt import expand_images

        return expand_images(ids, images, self._vision)

    # -- images ---------------------------------------------------------------------------------------------
    def attach_image(self, encoder: Any, image: Any) -> None:
        """Attach ``image`` (a :class:`mlxkv.vision.prompt.PreparedImage` of ``encoder``) to the next message."""
        self._vision = encoder
        self.pending_images.append(image)

    def images_of(self, message: Message) -> tuple:
        """The images a message of the conversation holds."""
        return self._images.get(id(message), (None, ()))[1]

    @property
    def holds_images(self) -> bool:
        """Whether the conversation (or the next message) holds an image."""
        return bool(self.pending_images) or any(id(m) in self._images for m in self.messages)

    def image_marker(self) -> str:
        """The text an image becomes in a message (the image family's marker token)."""
        if self._vision is None:
            return ""
        return self._vision.family.marker_text(self.tokenizer)

    # -- a turn ---------------------------------------------------------------------------------------------
    def turn(self, text: str, params: SamplingParams, *, stop_requested: Callable[[], bool] = lambda: False
             ) -> Iterator[str]:
        """Answer the user message ``text``, yielding the answer's text as it is produced.

        The answer (cut short, if ``stop_requested`` turned true between tokens or the consumer closed the
        iterator) joins the conversation when the iterator ends; a turn that fails with an exception, or that is
        stopped before its prefill ends (``stop_requested`` is checked between prefill chunks too), leaves the
        conversation as it was (the cache keeps the prefilled tokens for a repeated message).

        Raises:
            ValueError: an empty message, or one too long for the context.
        """
        if not text.strip():
            raise ValueError("the message is empty")
        images, self.pending_images = tuple(self.pending_images), []
        message = {"role": "user", "content": self.image_marker() * len(images) + text}
        candidate = [*self.messages, message]
        if images:
            self._images[id(message)] = (message, images)
        try:
            limit = self.limit
            if limit is None:
                messages, prompt, dropped = candidate, self.render(candidate), 0
            else:
                messages, prompt, dropped = fit_conversation(candidate, self.render, limit, params.max_tokens)
                if len(prompt) >= limit:
                    raise ValueError(f"the message is too long: the conversation needs {len(prompt)} tokens and "
                                     f"the context holds {limit} (--max-kv-size or the model's limit)")
            media = self._prompt(messages)[1] if self._images else ()
        except Exception:
            self._images.pop(id(message), None)
            self.pending_images = list(images)
            raise
        max_new = params.max_tokens if limit is None else min(params.max_tokens, limit - len(prompt))
        stats = self.last = TurnStats(prompt_tokens=len(prompt), dropped_turns=dropped)
        previous, self.messages = self.messages, messages
        pieces: list[str] = []
        failed = False
        try:
            for piece in self._on_engine(prompt, params, max_new, stats, stop_requested, media):
                pieces.append(piece)
                yield piece
        except PrefillStopped:  # nothing was answered: the message is not part of the conversation
            failed, self.messages, stats.finish_reason = True, previous, "interrupted"
        except Exception:  # a failed turn leaves the conversation as it was (the cache keeps what is valid)
            failed, self.messages = True, previous
            raise
        finally:
            if failed:  # its images wait for the next message
                self._images.pop(id(message), None)
                self.pending_images = list(images)
            if not failed:
                self.messages.append({"role": "assistant", "content": "".join(pieces)})

    def _on_engine(self, prompt: list[int], params: SamplingParams, max_new: int, stats: TurnStats,
                   stop_requested: Callable[[], bool], media: tuple = ()) -> Iterator[str]:
        """The turn's request on the engine: it continues the conversation's sequence, trimmed back to the prompt's
        common prefix with what it holds, so only the rest of the prompt is prefilled (``media``: the prompt's
        images, by position)."""
        self._trim_to(plan_turn(self.tokens, prompt).keep)
        request = dataclasses.replace(params, max_tokens=max_new, stop=())  # stop strings: the stream below
        stream = TextStream(self.tokenizer, params.stop, max_new)
        start = time.perf_counter()
        tokens = self.engine.generate_tokens(prompt, request, should_stop=stop_requested, sequence=self.sequence,
                                             media=media)
        shown: list[int] = []
        emitted: list[str] = []  # the text yielded so far
        try:
            # Every token the engine yields is shown, even after a stop request (the engine takes no step past it):
            # the answer's text then renders back to what the cache holds, and the next turn reuses all of it.
            for token in tokens:
                if not shown:  # the first token: the prompt is in the cache
                    stats.prefill_seconds = time.perf_counter() - start
                    start = time.perf_counter()
                stats.generation_tokens += 1
                stats.generation_seconds = time.perf_counter() - start
                piece, finish = stream.feed(token)
                shown.append(token)
                if piece:
                    emitted.append(piece)
                    yield piece
                if finish is not None:
                    stats.finish_reason = finish
                    return
            if stop_requested():
                stats.finish_reason = "interrupted"
                # What the stream still held back (a partial character or stop-string prefix) joins the answer,
                # so that its text renders back to the tokens the cache holds.
                full, said = (self.tokenizer.decode(shown), "".join(emitted)) if shown else ("", "")
                if full.startswith(said) and len(full) > len(said):
                    yield full[len(said):]
        finally:
            tokens.close()  # the request ends (its sequence stays open)
            stats.cached_tokens = self.engine.last_stats.cached_prompt_tokens  # where the engine's prefill began
            stats.prefill_tokens = len(prompt) - stats.cached_tokens
            done = self.engine.last_stats
            stats.drafted_tokens, stats.accepted_tokens = done.drafted_tokens, done.accepted_tokens
            stats.decode_forwards = done.target_forwards
            self._settle(prompt + self.engine.last_generated)

    def _settle(self, fed: list[int]) -> None:
        """Record what the caches hold after a turn: the first ``offset`` tokens of ``fed`` (the prompt and the
        tokens generated; the last generated one may not have been fed back). Where a turn ended early (an
        error mid-forward may leave later layers one step behind), every layer is brought back to the shortest."""
        offsets = [c.offset for c in each_layer_cache(self.caches) if hasattr(c, "offset")]
        held = min(offsets) if offsets else len(fed)
        assert held <= len(fed), f"the caches hold {held} tokens, the turn fed {len(fed)}"
        self.tokens = list(fed[:held])
        if offsets and max(offsets) != held:
            self._trim_to(held)

    def _trim_to(self, keep: int) -> int:
        """Bring the caches back to their first ``keep`` tokens; returns the tokens kept (0 when some layer
        cannot rewind that far, e.g. a sliding window or a recurrent layer's state: the conversation's sequence
        then starts over)."""
        try:
            for c in each_layer_cache(self.caches):
                if not hasattr(c, "offset"):  # recurrent state (mlx-lm ArraysCache): it holds every token, no rewind
                    if keep < len(self.tokens):
                        raise RewindError("a recurrent layer's state cannot be rewound")
                    continue
                if c.offset > keep:
                    want = c.offset - keep
                    removed = c.trim(want)
                    assert removed == want, f"{type(c).__name__} trimmed {removed} of {want} tokens"
        except RewindError:
            pool = self.engine.pool
            pool.release(self.sequence.id)
            self.sequence, keep = pool.open(), 0
        del self.tokens[keep:]
        return keep


__all__ = ["ChatSession", "TurnStats"]
