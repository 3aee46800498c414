"""The built-in page over HTTP (``GET /`` and its assets, ``--no-ui``) and the block map it draws
(``GET /v1/cache/blocks``: states, owners, the prefix tree, filtered per viewer), on a real server on loopback."""

from __future__ import annotations

import httpx
import pytest

from testkit.run_config import run_config
from testkit.serve_thread import serve_in_thread

from mlxkv.server import cache_routes
from mlxkv.server.cache_view import OTHERS as OTHERS_LABEL
from mlxkv.server.ui_routes import ASSETS

pytestmark = pytest.mark.server

KEY, ADMIN = "user-key", "admin-key"
PROMPT = "the quick brown fox jumps over the lazy dog " * 6  # a few whole blocks of 16 tokens


@pytest.fixture(autouse=True)
def fresh_block_maps(monkeypatch):
    """Every read draws the map anew (the route reuses one for BLOCK_MAP_REUSE_S; these tests read right after
    their requests)."""
    monkeypatch.setattr(cache_routes, "BLOCK_MAP_REUSE_S", 0.0)


@pytest.fixture(scope="module")
def srv(llama_dir):
    with serve_in_thread(run_config(llama_dir, kv_backend="paged"), model_name="tiny", api_key=KEY,
                         admin_key=ADMIN) as s:
        yield s


def complete(srv, salt: str | None = None, key: str = KEY) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(f"{srv.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def blocks(srv, key: str, **params) -> httpx.Response:
    return httpx.get(f"{srv.url}/v1/cache/blocks", params=params, headers={"Authorization": f"Bearer {key}"})


def test_page_and_assets_are_served_with_their_types_and_no_outside_origin(srv):
    page = httpx.get(srv.url + "/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert "default-src 'self'" in page.headers["content-security-policy"]
    html = page.text
    for name, kind in ASSETS.items():
        if name != "index.html":
            assert f"/ui/{name}" in html
            r = httpx.get(f"{srv.url}/ui/{name}")
            assert r.status_code == 200 and r.headers["content-type"] == kind and len(r.content) > 100
    for text in (html, httpx.get(srv.url + "/ui/app.js").text):  # no CDN: nothing is loaded from elsewhere
        assert "http://" not in text and "https://" not in text
    assert httpx.get(srv.url + "/ui/secret.txt").status_code == 404
    assert httpx.get(srv.url + "/ui/..%2Fapp.py").status_code == 404


def test_the_page_holds_no_data_and_its_data_routes_need_the_key(srv):
    """The page is a static shell that asks for the key; every figure it shows comes from a /v1 route."""
    assert 'id="key-form"' in httpx.get(srv.url + "/").text
    for path in ("/v1/cache/blocks", "/v1/cache/stats", "/v1/models"):
        r = httpx.get(srv.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
        assert httpx.get(srv.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert blocks(srv, KEY).status_code == 200


def test_no_ui_leaves_the_page_out(llama_dir):
    with serve_in_thread(run_config(llama_dir, kv_backend="paged"), model_name="tiny", ui=False) as s:
        for path in ("/", "/ui/app.js"):
            r = httpx.get(s.url + path)
            assert r.status_code == 404 and r.headers["content-type"] == "application/json"
        assert httpx.get(s.url + "/v1/cache/blocks").status_code == 200


def test_serve_lists_no_ui():
    from typer.testing import CliRunner

    from mlxkv.cli.main import app

    out = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"})
    assert out.exit_code == 0 and "--no-ui" in out.output and "built-in web page" in out.output


def test_block_map_shows_states_and_the_prefix_tree_with_hits(srv):
    before = blocks(srv, ADMIN, cache_salt="map-tenant").json()
    first = complete(srv, salt="map-tenant")
    second = complete(srv, salt="map-tenant")
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    view = blocks(srv, ADMIN, cache_salt="map-tenant").json()
    assert view["paged"] and view["view"] == "all" and view["block_size"] == 16
    assert len(view["states"]) == view["total"] == len(view["owners"]) == len(view["priorities"])
    assert set(view["states"]) <= set("fcus") and view["states"] != before["states"]
    own = [i for i, t in enumerate(view["tenants"]) if t["own"]]
    assert len(own) == 1 and view["tenants"][own[0]]["label"].startswith("t-")
    mine = [n for n in view["tree"]["nodes"] if n["owner"] == own[0]]
    whole = first["usage"]["prompt_tokens"] // 16
    assert len(mine) >= whole
    roots = [n for n in mine if n["parent"] is None]
    assert len(roots) == 1 and roots[0]["hits"] >= 1 and "quick brown fox" in roots[0]["text"]
    chain = {n["block"]: n for n in mine}
    for n in mine:  # a depth-first tree: each node's parent comes before it, one level up
        if n["parent"] is not None:
            assert chain[n["parent"]]["depth"] == n["depth"] - 1
    for i in (n["block"] - 1 for n in mine):
        assert view["states"][i] in "cs" and view["owners"][i] == own[0] and view["priorities"][i] is not None


def test_a_tenant_sees_its_own_blocks_only(srv):
    complete(srv, salt="alice")
    complete(srv, salt="bob")
    alice = blocks(srv, KEY, cache_salt="alice").json()
    assert alice["view"] == "tenant"
    labels = [t["label"] for t in alice["tenants"]]
    assert alice["tenants"][0]["own"] and labels[1:] == ["others"]
    texts = [n["text"] for n in alice["tree"]["nodes"]]
    assert texts and all(n["owner"] == 0 for n in alice["tree"]["nodes"])
    assert "quick brown fox" in "".join(texts)
    others = [i for i, o in enumerate(alice["owners"]) if o == 1]
    assert others and all(alice["priorities"][i] is None for i in others)
    admin_bob = blocks(srv, ADMIN, cache_salt="bob").json()
    bob = next(i for i, t in enumerate(admin_bob["tenants"]) if t["own"])
    bob_blocks = {n["block"] for n in admin_bob["tree"]["nodes"] if n["owner"] == bob}
    assert bob_blocks and not bob_blocks & {n["block"] for n in alice["tree"]["nodes"]}
    # a tenant without blocks yet sees nothing of anyone's
    carol = blocks(srv, KEY, cache_salt="carol").json()
    assert carol["tree"]["nodes"] == [] and [t["label"] for t in carol["tenants"]] == ["others"]
    # the salts themselves never appear, not even to the admin
    assert "alice" not in blocks(srv, ADMIN).text


def test_block_map_refuses_a_bad_salt_and_is_plain_on_the_dense_backend(srv, llama_dir):
    r = blocks(srv, KEY, cache_salt="x" * 300)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    with serve_in_thread(run_config(llama_dir, kv_backend="dense"), model_name="tiny") as s:
        assert httpx.get(s.url + "/v1/cache/blocks").json() == {"paged": False}


def test_viewers_within_the_reuse_window_share_one_map(srv, monkeypatch):
    monkeypatch.setattr(cache_routes, "BLOCK_MAP_REUSE_S", 60.0)
    first = blocks(srv, KEY).json()
    complete(srv, salt="late")
    assert blocks(srv, KEY).json()["states"] == first["states"]  # the map drawn a moment ago
    monkeypatch.setattr(cache_routes, "BLOCK_MAP_REUSE_S", 0.0)
    assert blocks(srv, KEY).json()["states"] != first["states"]


def test_block_map_of_a_stopped_engine_is_a_503(llama_dir):
    with serve_in_thread(run_config(llama_dir, kv_backend="paged"), model_name="tiny") as s:
        s.parts.engine.stop()
        r = httpx.get(s.url + "/v1/cache/blocks")
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"


def test_a_server_without_keys_shows_every_tenant_to_anonymous_callers_only(llama_dir):
    with serve_in_thread(run_config(llama_dir, kv_backend="paged"), model_name="tiny") as s:
        for salt in ("x", "y"):
            assert httpx.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1,
                                                               "cache_salt": salt}).status_code == 200
        anonymous = httpx.get(s.url + "/v1/cache/blocks").json()
        assert anonymous["view"] == "all" and OTHERS_LABEL not in [t["label"] for t in anonymous["tenants"]]
        keyed = httpx.get(s.url + "/v1/cache/blocks", params={"cache_salt": "x"},
                          headers={"Authorization": "Bearer unused"}).json()  # as the openai client sends
        assert keyed["view"] == "tenant" and [t["label"] for t in keyed["tenants"]][1:] == [OTHERS_LABEL]


def test_a_tenant_key_never_reads_another_tenants_text(llama_dir):
    """On a server whose API keys are two tenants, each key's map shows its own prompts' text and none of the
    other's, with no salt sent (the tenant is the key); the admin key sees both tenants."""
    from mlxkv.server.tenancy import Tenants

    alice, bob = "alice-key-0123456789", "bob-key-9876543210"
    with serve_in_thread(run_config(llama_dir, kv_backend="paged"), model_name="tiny", admin_key=ADMIN,
                         tenants=Tenants.from_options([alice, bob], None, ADMIN)) as two:
        complete(two, key=alice)
        body = {"model": "tiny", "prompt": "pack my box with five dozen liquor jugs " * 6, "max_tokens": 2}
        assert httpx.post(f"{two.url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {bob}"}).status_code == 200
        views = {key: blocks(two, key).json() for key in (alice, bob, ADMIN)}
    assert all("tree" in view for view in views.values()), views
    text = {key: "".join(n["text"] for n in view["tree"]["nodes"]) for key, view in views.items()}
    assert "quick brown fox" in text[alice] and "liquor jugs" not in text[alice]
    assert "liquor jugs" in text[bob] and "quick brown fox" not in text[bob]
    assert views[alice]["view"] == views[bob]["view"] == "tenant"
    assert "quick brown fox" in text[ADMIN] and "liquor jugs" in text[ADMIN]
