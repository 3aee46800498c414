"""One choice's token events turned into the parts of its response: content, reasoning and log-probabilities.

Both the whole response and the stream read a choice through :class:`ChoiceOutput`, so they carry the same text,
the same reasoning split and the same log-probabilities. Log-probability objects take OpenAI's shapes:

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}]}``;
- completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``, where each
  ``top_logprobs`` entry holds the sampled token too (up to ``logprobs + 1`` entries, as OpenAI documents) and
  ``text_offset`` counts characters from the start of the completion (the prompt is never echoed).

An end-of-sequence token has no text and no entry. In a stream, a token's entry rides on the next chunk that
carries text (the detokenizer may hold a token's text back), or on the choice's last chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mlxkv.engine.output import TokenLogprob
from mlxkv.server.reasoning import ReasoningSplitter
from mlxkv.server.token_text import TokenText
from mlxkv.server.tool_stream import ToolOutput


@dataclass
class Delta:
    """What a choice adds to its response at one event."""

    content: str = ""
    reasoning: str = ""
    logprobs: dict | None = None  # the route's log-probability object for the tokens it covers
    tool_calls: list[dict] = field(default_factory=list)  # calls completed at this event

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.logprobs or self.tool_calls)


class LogprobFormat:
    """OpenAI's log-probability objects of one route.

    Args:
        token_text: token id -> text and bytes.
        eos: end-of-sequence ids (reported without an entry).
        chat: chat's shape, else the completions shape.
    """

    def __init__(self, token_text: TokenText, eos: set[int], chat: bool):
        self.token_text, self.eos, self.chat = token_text, eos, chat

    def entry(self, lp: TokenLogprob) -> dict | None:
        """The entry of one token (``None`` for end-of-sequence)."""
        if lp.token in self.eos:
            return None
        text, raw = self.token_text(lp.token)
        if not self.chat:
            top = {self.token_text(t)[0]: v for t, v in lp.top}
            top.setdefault(text, lp.logprob)
            return {"token": text, "logprob": lp.logprob, "top": top}
        alternatives = []
        for token, value in lp.top:
            t_text, t_raw = self.token_text(token)
            alternatives.append({"token": t_text, "logprob": value, "bytes": list(t_raw)})
        return {"token": text, "logprob": lp.logprob, "bytes": list(raw), "top_logprobs": alternatives}

    def block(self, entries: list[dict], offset: int) -> dict:
        """The object for ``entries`` (the first token's text starting ``offset`` characters into the output)."""
        if self.chat:
            return {"content": entries}
        offsets = []
        for e in entries:
            offsets.append(offset)
            offset += len(e["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [e["top"] for e in entries], "text_offset": offsets}


@dataclass
class ChoiceOutput:
    """One choice's accumulated output.

    Args:
        splitter: splits reasoning from content (``None``: everything is content).
        logprob_format: formats log-probabilities (``None``: the request asked for none).
        tools: parses tool calls out of the content (``None``: the request uses no tools); ``index`` is this
            choice's index among the request's choices, as ``tools`` knows them.
    """

    splitter: ReasoningSplitter | None = None
    logprob_format: LogprobFormat | None = None
    tools: ToolOutput | None = None
    index: int = 0
    content: list[str] = field(default_factory=list)
    calls: list[dict] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    entries: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    _pending: list[dict] = field(default_factory=list)  # entries not streamed yet
    _offset: int = 0  # characters of output the streamed entries cover

    def feed(self, text: str, logprob: TokenLogprob | None, finish_reason: str | None) -> Delta:
        """Add one token event's text, log-probability and finish reason; returns what it adds."""
        reasoning, content = self.splitter.feed(text) if self.splitter is not None else ("", text)
        if finish_reason is not None:
            self.finish_reason = finish_reason
            if self.splitter is not None:
                more_reasoning, more_content = self.splitter.flush()
                reasoning, content = reasoning + more_reasoning, content + more_content
        calls: list[dict] = []
        if self.tools is not None:  # tool-call markup leaves the content, the calls come out whole
            content, calls, finish_reason = self.tools.feed(self.index, content, finish_reason)
            self.calls += calls
            self.finish_reason = finish_reason or self.finish_reason
        self.reasoning.append(reasoning)
        self.content.append(content)
        if self.logprob_format is not None and logprob is not None:
            entry = self.logprob_format.entry(logprob)
            if entry is not None:
                self.entries.append(entry)
                self._pending.append(entry)
        delta = Delta(content, reasoning, tool_calls=calls)
        if self._pending and (text or finish_reason is not None):
            delta.logprobs = self.logprob_format.block(self._pending, self._offset)
            self._offset += sum(len(e["token"]) for e in self._pending)
            self._pending = []
        return delta

    def logprobs(self) -> dict | None:
        """The whole choice's log-probability object (``None`` when none were asked for)."""
        return None if self.logprob_format is None else self.logprob_format.block(self.entries, 0)

    def text(self) -> str:
        return "".join(self.content)

    @property
    def dropped_call(self) -> bool:
        """The choice ended in a tool call cut off by ``max_tokens`` that did not read (its markup dropped)."""
        return self.tools is not None and self.tools.dropped(self.index)

    def reasoning_text(self) -> str | None:
        """The reasoning, ``None`` when there is none or the model has no think markers."""
        return "".join(self.reasoning) or None
