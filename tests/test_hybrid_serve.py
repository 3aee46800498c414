"""``mlxkv serve`` on a recurrent hybrid (the qwen3_next test model), through the official ``openai`` client:
repeated and shared-prefix prompts are prefix hits (state snapshots), with the same greedy text as the first
time; the cache stats show the snapshots; after a graceful restart on the same disk tier folder the repeated prompt
hits from disk with the same text."""

import anthropic
import httpx
import pytest

from testkit.serve_process import serve_process
from testkit.serve_signals import server

pytestmark = pytest.mark.server

SYSTEM = "You are a terse assistant who answers in one word. " * 4
QUESTIONS = ["What colour is the sky?", "What is two plus two?"]


def completion(client, prompt):
    reply = client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0)
    details = reply.usage.prompt_tokens_details
    return reply.choices[0].text, reply.usage.prompt_tokens, details.cached_tokens if details else 0


def test_serve_hybrid_reuses_prefixes_exactly(test_model_dir):
    folder = test_model_dir("qwen3_next")
    with serve_process("-m", str(folder), "--kv-block-size", "16", "--state-snapshot-interval", "2",
                       "--log-level", "warning") as client:
        first = [completion(client, SYSTEM + q) for q in QUESTIONS]
        again = [completion(client, SYSTEM + q) for q in QUESTIONS]
        base = str(client.base_url).rstrip("/").removesuffix("/v1")
        stats = httpx.get(f"{base}/v1/cache/stats", timeout=30).json()
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
    assert [t for t, _, _ in again] == [t for t, _, _ in first]  # greedy text with reuse == without
    n0, n1 = first[0][1], first[1][1]
    assert first[0][2] == 0
    # the second question shares the system prompt: a hit at the deepest multiple of 2 blocks (32 tokens) in it
    assert first[1][2] > 0 and first[1][2] % 32 == 0
    # the repeats: a hit at each prompt's last block boundary before its last token
    assert [c for _, _, c in again] == [(n0 - 1) // 16 * 16, (n1 - 1) // 16 * 16]
    snaps = stats["state_snapshots"]
    assert stats["prefix_cache"]["enabled"] and snaps["enabled"] and snaps["hits"] == 3 and snaps["count"] > 0
    assert snaps["bytes_each"] == 4 * (3 * 128 + 4 * 16 * 16)
    assert "mlxkv_state_snapshot_hits_total 3.0" in metrics


def test_serve_hybrid_restart_hits_the_disk_tier(test_model_dir, tmp_path):
    folder = test_model_dir("qwen3_next")
    # a write interval longer than the test: only the flush at the graceful stop writes blocks and snapshots
    args = ("-m", str(folder), "--kv-block-size", "16", "--kv-disk-cache", str(tmp_path),
            "--kv-disk-write-interval", "3600")
    prompt = SYSTEM + QUESTIONS[0]
    with server(*args) as s:
        first = completion(s.client, prompt)
        rc, log = s.stop()
    assert rc == 0 and "Traceback" not in log, log
    with server(*args) as s:  # a restart on the same folder
        again = completion(s.client, prompt)
        stats = httpx.get(f"http://127.0.0.1:{s.port}/v1/cache/stats", timeout=30).json()
        assert s.stop()[0] == 0
    text, n, cached = again
    assert first[2] == 0 and cached == (n - 1) // 16 * 16  # all but the last block's tokens, from disk
    assert text == first[0]  # greedy text with the disk hit == without reuse
    assert stats["tier"]["secondary"]["hits_disk"] >= cached // 16 + 1  # the attention blocks and the snapshot
    assert stats["state_snapshots"]["hits"] == 1


def test_serve_hybrid_snapshots_each_chat_message_end(test_model_dir):
    from transformers import AutoTokenizer

    folder = test_model_dir("qwen3_next")
    tok = AutoTokenizer.from_pretrained(str(folder))
    systems = [SYSTEM, "You are a patient teacher who explains with examples. " * 4]

    def system_boundary(system):  # the last block boundary at or before the system message's end
        def ids(messages, more):
            return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=more, tokenize=False),
                              add_special_tokens=False)

        head = ids([{"role": "system", "content": system}], False)
        prompt = ids([{"role": "system", "content": system}, {"role": "user", "content": "Hi"}], True)
        end = next((i for i, (a, b) in enumerate(zip(head, prompt)) if a != b), len(head))
        assert end >= 32
        return end // 16 * 16

    long_question = QUESTIONS[0] * 4  # its prompt-end snapshot lies past what two users share
    with serve_process("-m", str(folder), "--kv-block-size", "16", "--log-level", "warning") as client:
        base = str(client.base_url).rstrip("/").removesuffix("/v1")
        claude = anthropic.Anthropic(base_url=base, api_key="none")

        def chat(system, question, **extra):
            r = client.chat.completions.create(
                model="m", messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
                max_tokens=8, temperature=0, **extra)
            details = r.usage.prompt_tokens_details
            return r.choices[0].message.content, details.cached_tokens if details else 0

        def message(system, question):
            r = claude.messages.create(model="m", system=system, max_tokens=4,
                                       messages=[{"role": "user", "content": question}])
            return r.usage.cache_read_input_tokens

        # no --state-snapshot-interval: users sharing a system prompt hit at its end, whichever API marked it
        first = message(systems[0], long_question)  # the Messages API marks the system message's end...
        second = chat(systems[0], QUESTIONS[1])  # ...where another user's chat completion resumes
        fresh = chat(systems[0], QUESTIONS[1], extra_body={"cache_salt": "alone"})  # the same, without reuse
        third = chat(systems[1], long_question)  # and the other way round
        fourth = message(systems[1], QUESTIONS[1])
    assert first == 0 and fresh[1] == 0 and third[1] == 0
    assert second[1] == system_boundary(systems[0]) and fourth == system_boundary(systems[1])
    assert second[0] == fresh[0]  # greedy text with the snapshot hit == without reuse
