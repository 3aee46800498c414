"""ChatSession on the embedded demo model: the cache carried across turns gives the answers a whole-history
prefill gives, save/load round trips exactly, long conversations drop turns and keep answering."""

from __future__ import annotations

import mlx.core as mx
from mlx.utils import tree_flatten
import pytest

from mlxkv.chat import ChatSession, load_session, save_session
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv import each_layer_cache

GREEDY = SamplingParams(max_tokens=12)
QUESTIONS = ("Hello, who are you?", "Tell me about the sea.", "And the mountains?")


@pytest.fixture(scope="module")
def demo():
    from mlxkv.models import load

    return load(None)


def _session(demo, **kw) -> ChatSession:
    return ChatSession(demo.model, demo.tokenizer, system="Be brief.",
                       model_limit=demo.config["max_position_embeddings"], **kw)


def _answer(session: ChatSession, text: str, params: SamplingParams = GREEDY) -> str:
    return "".join(session.turn(text, params))


def _offsets(session: ChatSession) -> set[int]:
    return {c.offset for c in each_layer_cache(session.caches)}


def _fresh_answer(demo, messages: list[dict], text: str) -> str:
    """The answer of a session that prefills the whole conversation (nothing cached)."""
    fresh = _session(demo)
    fresh.messages = [dict(m) for m in messages]
    return _answer(fresh, text)


def test_later_turns_prefill_only_the_new_tokens_and_answer_as_a_whole_prefill_would(demo):
    s = _session(demo)
    _answer(s, QUESTIONS[0])
    for q in QUESTIONS[1:]:
        before, history = list(s.tokens), [dict(m) for m in s.messages]
        answer = _answer(s, q)
        prompt = s.render(history + [{"role": "user", "content": q}])
        assert s.last.prompt_tokens == len(prompt)
        assert s.last.cached_tokens == len(before)  # the whole previous turn came from the cache
        assert prompt[:len(before)] == before  # ... and is the template's own rendering of it
        assert s.last.prefill_tokens == len(prompt) - len(before) < 25  # only the new message and its markers
        assert answer == _fresh_answer(demo, history, q)
        assert _offsets(s) == {len(s.tokens)}


def test_a_rerendered_history_trims_the_cache_back_to_the_common_prefix(demo):
    s = _session(demo)
    _answer(s, QUESTIONS[0])
    s.messages[-1]["content"] = "I am a model."  # the history now renders differently from what was generated
    first_prompt = s.render(s.messages[:2])
    history = [dict(m) for m in s.messages]
    answer = _answer(s, QUESTIONS[1])
    assert len(first_prompt) - 1 <= s.last.cached_tokens < len(first_prompt) + 3
    assert answer == _fresh_answer(demo, history, QUESTIONS[1])


def test_save_then_load_continues_exactly_as_the_live_session(demo, tmp_path):
    live = _session(demo)
    _answer(live, QUESTIONS[0])
    save_session(live, tmp_path, "one", "fp", "demo")
    resumed = _session(demo)
    load_session(resumed, tmp_path, "one", "fp")
    assert resumed.messages == live.messages and resumed.tokens == live.tokens
    for a, b in zip(each_layer_cache(live.caches), each_layer_cache(resumed.caches)):
        assert type(a) is type(b) and a.offset == b.offset
        for x, y in zip(tree_flatten(a.state), tree_flatten(b.state)):
            assert mx.array_equal(x[1], y[1])
    saved_tokens = len(live.tokens)
    assert _answer(resumed, QUESTIONS[1]) == _answer(live, QUESTIONS[1])
    assert resumed.last.cached_tokens == live.last.cached_tokens == saved_tokens  # the resumed turn prefills no history


def test_a_session_saved_for_another_model_is_refused(demo, tmp_path):
    s = _session(demo)
    _answer(s, QUESTIONS[0])
    save_session(s, tmp_path, "other", "fingerprint-a", "SmolLM2")
    with pytest.raises(ValueError, match="saved with SmolLM2, not this model"):
        load_session(_session(demo), tmp_path, "other", "fingerprint-b")
    with pytest.raises(ValueError, match="no saved session 'missing'.*saved: other"):
        load_session(s, tmp_path, "missing", "fingerprint-a")
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="not an mlxkv chat session"):
        load_session(s, tmp_path, "junk", "fingerprint-a")
    with pytest.raises(ValueError, match="bad session name"):
        save_session(s, tmp_path, "../up", "fingerprint-a")


def test_a_stopped_answer_keeps_the_cache_consistent_and_the_next_turn_exact(demo):
    s = _session(demo)
    seen = []
    answer = "".join(seen.append(p) or p for p in s.turn(QUESTIONS[0], SamplingParams(max_tokens=200),
                                                          stop_requested=lambda: len(seen) >= 3))
    assert s.last.generation_tokens < 200 and s.messages[-1] == {"role": "assistant", "content": answer}
    assert _offsets(s) == {len(s.tokens)}
    history = [dict(m) for m in s.messages]
    assert _answer(s, QUESTIONS[1]) == _fresh_answer(demo, history, QUESTIONS[1])


def test_a_closed_turn_iterator_keeps_the_partial_answer(demo):
    s = _session(demo)
    turn = s.turn(QUESTIONS[0], SamplingParams(max_tokens=100))
    first = next(turn)
    turn.close()  # what a consumer interrupted mid-answer does
    assert s.messages[-1] == {"role": "assistant", "content": first}
    assert _offsets(s) == {len(s.tokens)}


def test_a_conversation_past_max_kv_size_drops_turns_and_keeps_answering(demo):
    s = _session(demo, max_kv_size=96)
    dropped = 0
    for i in range(8):
        history = [dict(m) for m in s.messages]
        answer = _answer(s, f"Question number {i}: what next?")
        assert answer
        assert s.context_tokens <= 96 and _offsets(s) == {len(s.tokens)}
        assert s.messages[0] == {"role": "system", "content": "Be brief."}
        dropped += s.last.dropped_turns
        if s.last.dropped_turns:  # the kept conversation answers as a fresh prefill of it would
            kept = s.messages[:-2]
            assert len(kept) < len(history)
            assert answer == _fresh_answer(demo, kept, f"Question number {i}: what next?")
    assert dropped >= 2


def test_a_message_longer_than_the_context_is_refused_and_the_session_survives(demo):
    s = _session(demo, max_kv_size=40)
    with pytest.raises(ValueError, match="too long"):
        _answer(s, "word " * 60)
    assert _answer(s, "Hi")  # the session still answers
    with pytest.raises(ValueError, match="empty"):
        _answer(s, "   ")


def test_reset_and_system(demo):
    s = _session(demo)
    _answer(s, QUESTIONS[0])
    s.set_system("Be long.")
    assert s.messages[0] == {"role": "system", "content": "Be long."} and len(s.messages) == 3
    s.reset(s.system)
    assert s.messages == [{"role": "system", "content": "Be long."}] and s.context_tokens == 0
    s.set_system(None)
    assert s.messages == [] and s.system is None
    assert _answer(s, QUESTIONS[0]) == _fresh_answer(demo, [], QUESTIONS[0])


def test_a_failed_turn_leaves_the_conversation_as_it_was(demo, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="head_dim 48"):  # no valid group size for the demo's head_dim: refused
        _session(demo, kv_bits=8, kv_group_size=32)  # when the session starts, not at its first message
    s = _session(demo)

    def failing_prefill(*args, **kwargs):
        raise ValueError("a forward failed")

    monkeypatch.setattr(s.engine.scheduler.runner, "prefill", failing_prefill)
    with pytest.raises(ValueError, match="a forward failed"):
        _answer(s, QUESTIONS[0])
    assert s.messages == [{"role": "system", "content": "Be brief."}] and _offsets(s) == {len(s.tokens)}
    monkeypatch.undo()
    s.kv_bits = 8  # a session of a quantized cache (which the demo model cannot have) meets a plain save
    plain = _session(demo)
    _answer(plain, QUESTIONS[0])
    save_session(plain, tmp_path, "plain", "fp")
    with pytest.raises(ValueError, match="saved with no --kv-bits: resume it with that"):
        load_session(s, tmp_path, "plain", "fp")


def test_the_engine_refuses_a_sequence_holding_the_whole_prompt(demo):
    s = _session(demo)
    _answer(s, QUESTIONS[0])
    with pytest.raises(ValueError, match="the prompt must extend them"):  # the last prompt token gives the logits
        next(s.engine.generate_tokens(s.tokens, GREEDY, sequence=s.sequence))
    assert _answer(s, QUESTIONS[1])  # the conversation's sequence is untouched
