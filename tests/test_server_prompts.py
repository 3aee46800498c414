"""PromptEncoder: the chat template's own token ids, a long shared head tokenized once."""

from __future__ import annotations

import pytest
from mlx_lm.utils import load_tokenizer

from mlxkv.models import demo_model_path
from mlxkv.server.prompts import PromptEncoder

pytestmark = pytest.mark.server

SYSTEM = ("You are a careful assistant.  Answer in short sentences; quote code exactly, with tabs\tand  spaces. "
          "Ünïcödé, 日本語 and emoji 🙂 stay as they are. ") * 25  # ~3K characters
QUESTIONS = ["What is a tuple?", "  leading spaces and a trailing one ", "digits 0123456789", "x",
             "special text inside: </s> <s> <|user|> <|im_end|>", "\nnew line first"]


@pytest.fixture(scope="module", params=["demo", "test"])
def tokenizer(request, test_model_dir):
    return load_tokenizer(demo_model_path() if request.param == "demo" else test_model_dir("llama"))


def own(tokenizer, messages):
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def test_prompts_sharing_a_long_system_prompt_reuse_its_tokens_and_equal_the_templates(tokenizer):
    encoder = PromptEncoder(tokenizer)
    for i, question in enumerate(QUESTIONS * 2):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        assert encoder.chat(messages) == own(tokenizer, messages)
        assert encoder.hits == max(0, i - 1)  # the second prompt checks and fills the memo, later ones reuse it
    assert encoder.memo_on


def test_multi_turn_and_short_prompts_equal_the_templates(tokenizer):
    encoder = PromptEncoder(tokenizer)
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"},
               {"role": "assistant", "content": "hello ünïcödé 🙂"}]
    for question in QUESTIONS:
        messages = history + [{"role": "user", "content": question}]
        assert encoder.chat(messages) == own(tokenizer, messages)
    assert encoder.hits == len(QUESTIONS) - 2
    short = PromptEncoder(tokenizer)
    for question in QUESTIONS:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
        assert short.chat(messages) == own(tokenizer, messages)
    assert short.hits == 0  # a short head is not memoized


class _SplitsDifferently:
    """A tokenizer whose template ids are not its pieces' ids (an extra id at the end): the memo must stand down."""

    def __init__(self, inner):
        self.inner = inner
        self._tokenizer = inner._tokenizer
        self.chat_template = inner.chat_template

    def apply_chat_template(self, messages, **kwargs):
        out = self.inner.apply_chat_template(messages, **kwargs)
        return out if kwargs.get("tokenize") is False else list(out) + [7]

    def encode(self, text, **kwargs):
        return self.inner.encode(text, **kwargs)


def test_a_tokenizer_that_does_not_split_at_special_tokens_turns_the_memo_off(tokenizer, caplog):
    odd = _SplitsDifferently(tokenizer)
    encoder = PromptEncoder(odd)
    for question in QUESTIONS[:3]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        assert encoder.chat(messages) == own(odd, messages)
    assert not encoder.memo_on and encoder.hits == 0
    assert "tokenized whole" in caplog.text


class _CountingEncodes:
    """The tokenizer, counting its ``encode`` calls (what the memo adds to the template's own tokenization)."""

    def __init__(self, inner):
        self.inner, self.encodes = inner, 0
        self._tokenizer = inner._tokenizer
        self.chat_template = inner.chat_template

    def apply_chat_template(self, messages, **kwargs):
        return self.inner.apply_chat_template(messages, **kwargs)

    def encode(self, text, **kwargs):
        self.encodes += 1
        return self.inner.encode(text, **kwargs)


def test_a_head_met_once_costs_no_extra_encoding(tokenizer):
    counting = _CountingEncodes(tokenizer)
    encoder = PromptEncoder(counting)
    for i in range(3):  # three different system prompts, each met once
        messages = [{"role": "system", "content": f"{i} {SYSTEM}"}, {"role": "user", "content": "hi"}]
        assert encoder.chat(messages) == own(tokenizer, messages)
    assert counting.encodes == 0 and encoder.hits == 0
    messages = [{"role": "system", "content": f"2 {SYSTEM}"}, {"role": "user", "content": "again"}]
    assert encoder.chat(messages) == own(tokenizer, messages)  # met twice: checked (head + tail encoded)
    assert counting.encodes == 2


def test_template_errors_propagate(tokenizer):
    with pytest.raises(Exception):  # noqa: B017 - jinja raises its own types
        PromptEncoder(tokenizer).chat([{"role": "nobody", "content": SYSTEM}, {"role": "user", "content": "x"}])


def test_chat_if_cheap_answers_short_prompts_and_memoized_heads_only(tokenizer, monkeypatch):
    from mlxkv.server import prompts as prompts_module
    from mlxkv.server.prompts import CHEAP_CHARS

    counting = _CountingEncodes(tokenizer)
    encoder = PromptEncoder(counting)
    short = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert encoder.chat_if_cheap(short) == own(tokenizer, short)
    long_head = [{"role": "system", "content": SYSTEM * 3}, {"role": "user", "content": "What is a tuple?"}]
    assert len(SYSTEM * 3) > CHEAP_CHARS
    assert encoder.chat_if_cheap(long_head) is None  # not memoized yet: nothing encoded
    assert counting.encodes == 0
    for question in QUESTIONS[:2]:  # met, then checked and memoized
        encoder.chat([long_head[0], {"role": "user", "content": question}])
    before = counting.encodes
    for question in QUESTIONS:
        messages = [long_head[0], {"role": "user", "content": question}]
        assert encoder.chat_if_cheap(messages) == own(tokenizer, messages)
    assert counting.encodes - before == len(QUESTIONS)  # the tails only
    long_tail = [long_head[0], {"role": "user", "content": "why? " * (CHEAP_CHARS // 5 + 1)}]
    assert encoder.chat_if_cheap(long_tail) is None
    assert encoder.chat(long_tail) == own(tokenizer, long_tail)
    assert encoder.chat_if_cheap(long_head) == own(tokenizer, long_head)
    monkeypatch.setattr(prompts_module, "CHEAP_RENDER_CHARS", len(SYSTEM * 3))  # too long to render on the loop
    assert encoder.chat_if_cheap(long_head) is None
