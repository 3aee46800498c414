"""``POST /v1/cache/reset`` per tenant on a real server: a ``cache_salt`` drops only that tenant's cached blocks;
a reset of every tenant, and the KV events stream, need the admin key on a server started with one."""

from __future__ import annotations

import httpx
import pytest

from mlxkv.engine.batch import EngineConfig
from testkit.run_config import run_config
from testkit.serve_thread import openai_client, serve_in_thread

pytestmark = pytest.mark.server

API, ADMIN = "user-key", "admin-key"
QUESTION = "Explain, in a few words, what a Python generator is and when one would use it instead of a list."


@pytest.fixture(scope="module")
def server(test_model_dir):
    config = run_config(str(test_model_dir("llama")), engine=EngineConfig(max_sequences=2), kv_backend="paged")
    with serve_in_thread(config, model_name="m", api_key=API, admin_key=ADMIN) as srv:  # its own: resets, events
        yield srv


def ask(server, salt, key=API):
    client = openai_client(server.url, api_key=key)
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=2,
                                           temperature=0, extra_body={"cache_salt": salt})
    return reply.usage.prompt_tokens_details.cached_tokens


def reset(server, body=None, key=API):
    kwargs = {} if body is None else {"json": body}
    return httpx.post(server.url + "/v1/cache/reset", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      **kwargs)


def cached_blocks(server):
    stats = httpx.get(server.url + "/v1/cache/stats", headers={"Authorization": f"Bearer {API}"}).json()
    return stats["kv_blocks"]["cached"]


def test_a_tenant_resets_only_its_own_blocks_and_everything_needs_the_admin_key(server):
    for salt in ("tenant-a", "tenant-b"):
        ask(server, salt)
        assert ask(server, salt) > 0  # each tenant's prompt is cached
    before = cached_blocks(server)

    r = reset(server)  # every tenant, with the ordinary key
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    assert cached_blocks(server) == before

    r = reset(server, {"cache_salt": "tenant-a"})
    assert r.status_code == 200 and r.json()["scope"] == "tenant"
    freed = r.json()["prefix_cache_blocks_freed"]
    assert 0 < freed < before and cached_blocks(server) == before - freed
    assert ask(server, "tenant-b") > 0  # the other tenant still hits
    assert ask(server, "tenant-a") == 0  # this one starts over

    r = reset(server, {"cache_salt": "x", "all": True})  # unknown fields are refused, not ignored
    assert r.status_code == 400
    r = reset(server, key=ADMIN)
    assert r.status_code == 200 and r.json()["scope"] == "all" and cached_blocks(server) == 0
    assert ask(server, "tenant-b", key=ADMIN) == 0  # the admin key also passes the API-key check


def test_the_events_stream_shows_every_tenant_and_so_needs_the_admin_key(server):
    ask(server, "tenant-c")
    url = server.url + "/v1/cache/events?stream=false"
    r = httpx.get(url, headers={"Authorization": f"Bearer {API}"}, timeout=60)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_key_required"
    r = httpx.get(url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60)
    assert r.status_code == 200 and any(e["type"] == "BlockStored" for e in r.json()["events"])
