"""A response's output items from token events (mlxkv.server.responses_api.output): a thinking model's reasoning
item before its message, the stream's event order and numbering, an incomplete response. Pure Python: the
engine's events are made here."""

from __future__ import annotations

from mlxkv.engine.request import Event, Usage
from mlxkv.server.choice_output import ChoiceOutput
from mlxkv.server.reasoning import ReasoningSplitter
from mlxkv.server.responses_api.output import ResponseOutput


def run(pieces: list[str], finish: str = "stop") -> tuple[ResponseOutput, list[dict]]:
    out = ResponseOutput({"id": "resp_x", "object": "response"},
                         ChoiceOutput(ReasoningSplitter("<think>", "</think>"), None, None, 0))
    events = out.opening()
    for i, text in enumerate(pieces):
        events += out.feed(Event("token", text=text, token=i, finish_reason=finish if i == len(pieces) - 1 else None))
    events += out.closing(Usage(10, len(pieces), 4))
    return out, events


def test_reasoning_item_then_message():
    out, events = run(["<think>", "Let me ", "see.", "</think>", "It is ", "blue."])
    body = events[-1]["response"]
    reasoning, message = body["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text",
                                                                         "text": "Let me see."}]
    assert message["type"] == "message" and message["content"][0]["text"] == "It is blue."
    assert body["status"] == "completed" and body["usage"]["output_tokens_details"]["reasoning_tokens"] == 2
    assert body["usage"]["input_tokens_details"]["cached_tokens"] == 4
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     "response.reasoning_text.delta", "response.reasoning_text.delta",
                     "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert out.assistant_message() == {"role": "assistant", "content": "It is blue."}  # no reasoning in history


def test_cut_by_max_output_tokens_is_incomplete():
    _, events = run(["Once ", "upon"], finish="length")
    body = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete" and body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
