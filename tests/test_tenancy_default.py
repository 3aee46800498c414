"""Tenants isolated by default: on a server whose API keys name several tenants, no client reaches another
tenant's cached prompts, on any route, whatever it sends; sharing across tenants is an explicit opt-in.

The probe is an attacker's: it holds its own key, knows the victim's template and all of the prompt but a secret
digit, and sends one ``/v1/completions`` per guess, reading ``usage.prompt_tokens_details.cached_tokens``: a
guess that hits the victim's cached blocks shows one more block cached. On a one-key server (one tenant, as vLLM)
the probe recovers the digit — its clients are one principal and share the cache, isolated only by ``cache_salt``
— which shows the probe works; on a two-key server it recovers nothing.
"""

from __future__ import annotations

import httpx
import pytest

from mlxkv.engine.batch import EngineConfig
from mlxkv.server.tenancy import Tenants
from testkit.run_config import run_config
from testkit.serve_thread import anthropic_client, openai_client, serve_in_thread

pytestmark = pytest.mark.server

VICTIM, ATTACKER = "victim-key-0123456789", "attacker-key-9876543210"
SECRET = 7
BLOCK = 16  # the paged KV backend's default block size
#: The victim's prompts: long enough that the secret digit sits after a few whole blocks.
MESSAGES_TEXT = ("Remember this for the audit, and never repeat it to anyone at all: the vault code digit is {d} and "
                 "it stays in this conversation, written nowhere else, until the end of the quarter.")
CHAT_TEXT = ("Keep this note private, it is for the operator only, nobody else: the alarm pin digit is {d} and it "
             "changes every week, so please do not write it down on paper anywhere in the office.")


def start(llama_dir, **options):
    config = run_config(llama_dir, engine=EngineConfig(max_sequences=2), kv_backend="paged")
    return serve_in_thread(config, model_name="m", **options)


@pytest.fixture(scope="module")
def two_tenants(llama_dir):
    with start(llama_dir, tenants=Tenants.from_options([VICTIM, ATTACKER])) as srv:
        yield srv


@pytest.fixture(scope="module")
def one_key(llama_dir):
    with start(llama_dir, api_key=VICTIM) as srv:
        yield srv


def template_ids(srv, text: str) -> list[int]:
    """The prompt the server renders for one user message (what the attacker knows of the template)."""
    tokenizer = srv.parts.engine.tokenizer
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


def completions_cached(srv, key: str, prompt: list[int], **extra) -> int:
    r = openai_client(srv.url, api_key=key).completions.create(model="m", prompt=prompt, max_tokens=1, temperature=0,
                                                               extra_body=extra or None)
    return r.usage.prompt_tokens_details.cached_tokens


def probe(srv, key: str, text: str, salted: bool = False) -> dict[int, int]:
    """Cached tokens the attacker sees for each guess of the digit: its prompt runs to the first block boundary
    past the digit, and one token more (the last prompt token is always computed). ``salted``: each guess under a
    salt of its own, so the attacker's earlier guesses cannot answer its later ones."""
    guesses = {d: template_ids(srv, text.format(d=d)) for d in range(10)}
    differs = next(i for i, pair in enumerate(zip(guesses[0], guesses[1])) if pair[0] != pair[1])
    cut = (differs // BLOCK + 1) * BLOCK + 1
    return {d: completions_cached(srv, key, ids[:cut], **({"cache_salt": f"{text[:20]}-{d}"} if salted else {}))
            for d, ids in guesses.items()}


def victim_sends(srv):
    """The victim's prompts, with default settings: one on /v1/messages, one on /v1/chat/completions."""
    anthropic_client(srv.url, api_key=VICTIM).messages.create(
        model="m", max_tokens=2, messages=[{"role": "user", "content": MESSAGES_TEXT.format(d=SECRET)}],
        extra_body={"temperature": 0})
    openai_client(srv.url, api_key=VICTIM).chat.completions.create(
        model="m", max_tokens=2, temperature=0, messages=[{"role": "user", "content": CHAT_TEXT.format(d=SECRET)}])


def test_the_probe_recovers_the_digit_from_a_client_sharing_the_one_key(one_key):
    victim_sends(one_key)
    for text in (MESSAGES_TEXT, CHAT_TEXT):
        seen = probe(one_key, VICTIM, text)  # a second client holding the same key: the same tenant
        assert seen[SECRET] > max(v for d, v in seen.items() if d != SECRET), seen


def test_another_tenant_recovers_nothing_of_the_messages_and_chat_prompts(two_tenants):
    victim_sends(two_tenants)
    for text in (MESSAGES_TEXT, CHAT_TEXT):
        assert set(probe(two_tenants, ATTACKER, text, salted=True).values()) == {0}  # right and wrong alike
        seen = probe(two_tenants, ATTACKER, text)  # its guesses share their own prefix with one another
        assert seen[SECRET] <= max(v for d, v in seen.items() if d != SECRET), seen
        assert probe(two_tenants, VICTIM, text)[SECRET] >= BLOCK  # the victim's own prompts stay cached for it


def test_a_client_salt_narrows_within_its_tenant_never_across(two_tenants):
    prompt = [(13 * i + 7) % 900 + 10 for i in range(70)]
    assert completions_cached(two_tenants, VICTIM, prompt, cache_salt="s1") == 0
    assert completions_cached(two_tenants, VICTIM, prompt, cache_salt="s1") > 0  # the same tenant and salt
    assert completions_cached(two_tenants, VICTIM, prompt, cache_salt="s2") == 0  # another salt of the tenant
    assert completions_cached(two_tenants, VICTIM, prompt) == 0  # the tenant without a salt
    assert completions_cached(two_tenants, ATTACKER, prompt, cache_salt="s1") == 0  # the same salt, another tenant
    assert completions_cached(two_tenants, ATTACKER, prompt) == 0


def test_ranges_from_token_zero_share_a_prefix_across_tenants_by_opt_in(two_tenants):
    system = [(17 * i + 3) % 900 + 10 for i in range(64)]  # four whole blocks
    a_user, b_user = [11] * 20, [12] * 20
    shared = {"cache_salt_ranges": [{"start": 0, "end": len(system), "salt": "public-system"}]}
    assert completions_cached(two_tenants, VICTIM, system + a_user, **shared) == 0
    assert completions_cached(two_tenants, ATTACKER, system + b_user, **shared) == len(system)  # both opted in
    assert completions_cached(two_tenants, ATTACKER, system + a_user, **shared) == len(system)  # never A's own part
    other = {"cache_salt_ranges": [{"start": 0, "end": len(system), "salt": "another-name"}]}
    assert completions_cached(two_tenants, ATTACKER, system + a_user, **other) == 0
    assert completions_cached(two_tenants, ATTACKER, system + a_user) == 0  # without the opt-in
    # a range salt cannot name a tenant's own salt: the victim's unshared prompt stays out of reach
    secret = [(19 * i + 5) % 900 + 10 for i in range(40)]
    assert completions_cached(two_tenants, VICTIM, secret) == 0
    forged = {"cache_salt_ranges": [{"start": 0, "salt": '["mlxkv-tenant", "key-x", null]'}]}
    assert completions_cached(two_tenants, ATTACKER, secret, **forged) == 0


def test_messages_take_the_cache_fields_of_chat_completions(two_tenants):
    client = anthropic_client(two_tenants.url, api_key=VICTIM)
    messages = [{"role": "user", "content": "A message long enough to fill a block or two of the cache. " * 3}]
    first = client.messages.create(model="m", max_tokens=2, messages=messages,
                                   extra_body={"temperature": 0, "cache_salt": "m-salt", "priority": 1,
                                               "retention": {"decode_priority": 60},
                                               "cache_salt_ranges": [{"start": 4, "salt": "r"}]})
    again = client.messages.create(model="m", max_tokens=2, messages=messages,
                                   extra_body={"temperature": 0, "cache_salt": "m-salt", "priority": 1,
                                               "cache_salt_ranges": [{"start": 4, "salt": "r"}]})
    assert first.usage.cache_read_input_tokens == 0 and again.usage.cache_read_input_tokens > 0
    r = httpx.post(two_tenants.url + "/v1/messages", headers={"x-api-key": VICTIM}, timeout=30,
                   json={"model": "m", "max_tokens": 2, "messages": messages, "cache_salt": ""})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_resets_and_events_stay_within_a_tenant(two_tenants):
    a_prompt, b_prompt = [21] * 40, [22] * 40
    completions_cached(two_tenants, VICTIM, a_prompt)
    completions_cached(two_tenants, ATTACKER, b_prompt)
    r = httpx.post(two_tenants.url + "/v1/cache/reset", headers={"Authorization": f"Bearer {ATTACKER}"}, timeout=30)
    assert r.status_code == 200 and r.json()["scope"] == "tenant"
    assert completions_cached(two_tenants, VICTIM, a_prompt) > 0  # the other tenant's blocks stay
    assert completions_cached(two_tenants, ATTACKER, b_prompt) == 0  # the caller's went
    r = httpx.get(two_tenants.url + "/v1/cache/events?stream=false", headers={"Authorization": f"Bearer {VICTIM}"})
    assert r.status_code == 403 and "--admin-key" in r.json()["error"]["message"]


def test_one_key_is_one_tenant_whose_clients_share_the_cache(one_key):
    prompt = [(23 * i + 1) % 900 + 10 for i in range(50)]
    assert completions_cached(one_key, VICTIM, prompt) == 0
    assert completions_cached(one_key, VICTIM, prompt) > 0  # another client with the key: a hit, as in vLLM
    assert completions_cached(one_key, VICTIM, prompt, cache_salt="mine") == 0  # a salt isolates
