"""``ChatSession`` (what ``mlxkv chat`` runs, on dense caches) on a recurrent hybrid (qwen3_next, random weights):
the recurrent state carries over between turns when the next prompt extends the cached tokens, the conversation
starts over when it would have to rewind (a recurrent state cannot), and every answer equals a fresh session's."""

import pytest

from mlxkv.chat import ChatSession
from mlxkv.engine.sampling import SamplingParams

QUESTIONS = ["hello there", "and again", "one more time"]


@pytest.fixture(scope="module")
def hybrid(test_model_dir):
    from mlxkv.models import load

    loaded = load(str(test_model_dir("qwen3_next")))
    return loaded.model, loaded.tokenizer


def fresh_answer(hybrid, history, question, params):
    """The answer of a new session given the same history (nothing cached)."""
    session = ChatSession(*hybrid, system="Be brief.")
    session.messages = [dict(m) for m in history]
    answer = "".join(session.turn(question, params))
    assert session.last.cached_tokens == 0
    return answer


@pytest.mark.parametrize("max_tokens", [1, 6])
def test_hybrid_chat_turns_are_exact(hybrid, max_tokens):
    params = SamplingParams(max_tokens=max_tokens)
    session = ChatSession(*hybrid, system="Be brief.")
    previous_prompt = 0
    for q in QUESTIONS:
        history = [dict(m) for m in session.messages]
        answer = "".join(session.turn(q, params))
        assert answer == fresh_answer(hybrid, history, q, params)
        if max_tokens == 1:  # the cache holds exactly the last prompt, which the next one extends
            assert session.last.cached_tokens == previous_prompt
        previous_prompt = session.last.prompt_tokens
