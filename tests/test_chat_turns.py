"""The turn diff (common prefix with the cache) and turn dropping of :mod:`mlxkv.chat.turns`: pure Python."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxkv.chat.turns import common_prefix, fit_conversation, plan_turn

tokens = st.lists(st.integers(0, 3), max_size=12)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([5], [4]) == 0


def test_a_turn_after_an_answer_prefills_only_what_the_template_adds():
    turn1 = [1, 10, 11, 2]  # <s> user message </s>
    answer = [20, 21]
    cached = turn1 + answer  # the cache holds the prompt and the answer's fed tokens
    turn2 = cached + [2, 12, 13, 2]  # the answer's end marker, the new message
    plan = plan_turn(cached, turn2)
    assert plan.keep == len(cached)
    assert plan.new_tokens == (2, 12, 13, 2)


def test_history_rendered_differently_falls_back_to_the_common_prefix():
    cached = [1, 10, 11, 2, 20, 21, 22]
    rerendered = [1, 10, 11, 2, 20, 30, 2, 12]  # the answer tokenized differently from how it was generated
    plan = plan_turn(cached, rerendered)
    assert plan.keep == 5
    assert plan.new_tokens == (30, 2, 12)


def test_a_fully_cached_prompt_still_runs_its_last_token():
    plan = plan_turn([1, 2, 3, 4], [1, 2, 3])
    assert (plan.keep, plan.new_tokens) == (2, (3,))


def test_an_empty_prompt_is_refused():
    with pytest.raises(ValueError, match="empty"):
        plan_turn([1], [])


@given(cached=tokens, prompt=tokens.filter(bool))
def test_the_plan_always_rebuilds_the_prompt_from_a_true_prefix(cached, prompt):
    plan = plan_turn(cached, prompt)
    assert list(cached[:plan.keep]) == list(prompt[:plan.keep])  # only matching tokens are reused
    assert list(prompt[:plan.keep]) + list(plan.new_tokens) == list(prompt)
    assert plan.new_tokens  # at least the last token runs
    assert plan.keep == min(common_prefix(cached, prompt), len(prompt) - 1)  # and no more is recomputed


def _render(messages) -> list[int]:
    """A template stand-in: 2 marker tokens per message plus one token per character, a generation prompt."""
    out = []
    for m in messages:
        out += [0, 1] + [ord(c) for c in m["content"]]
    return out + [9]


def _conversation(turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "sys"}]
    for i in range(turns):
        msgs += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer{i}"}]
    return msgs + [{"role": "user", "content": "new"}]


def test_a_conversation_that_fits_is_kept_whole():
    msgs = _conversation(3)
    kept, toks, dropped = fit_conversation(msgs, _render, limit=1000, reserve=10)
    assert (kept, toks, dropped) == (msgs, _render(msgs), 0)


def test_turns_are_dropped_from_the_front_keeping_the_system_message():
    msgs = _conversation(3)  # each old turn renders 4 + 9 = 13 tokens; sys 5, new 5, generation prompt 1
    kept, toks, dropped = fit_conversation(msgs, _render, limit=40, reserve=10)
    assert dropped == 2
    assert kept == [msgs[0], *msgs[5:]]  # system, the last old turn, the new message
    assert toks == _render(kept) and len(toks) + 10 <= 40


def test_the_new_message_and_the_system_message_are_never_dropped():
    msgs = _conversation(2)
    kept, toks, dropped = fit_conversation(msgs, _render, limit=5, reserve=10)
    assert dropped == 2
    assert kept == [msgs[0], msgs[-1]]
    assert len(toks) + 10 > 5  # it still does not fit: the caller decides (the session refuses or cuts short)


def test_without_a_system_message_the_first_turn_can_go():
    msgs = _conversation(2)[1:]
    kept, _, dropped = fit_conversation(msgs, _render, limit=25, reserve=0)
    assert dropped == 1 and kept[0] == {"role": "user", "content": "q1"}
