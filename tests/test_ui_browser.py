"""The built-in page in a real browser: headless Chromium (Debian's package) driven through the DevTools Protocol
against a server on loopback with an API key — the page asks for the key, a chat answer streams into the page, the
pool map and prefix tree change when a second request shares the prefix, "copy as curl" gives the request without
the key (with the JSON-schema and tools toggles), and a screenshot shows every part with no console error."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from testkit.browser import CHROMIUM, Browser
from testkit.run_config import run_config
from testkit.serve_thread import serve_in_thread

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)"),
]
TEMPLATE = str(Path(__file__).parent / "testkit" / "templates" / "tools_chatml.jinja")
KEY = "browser-key"


@pytest.fixture(scope="module")
def srv(llama_dir):
    config = run_config(llama_dir, kv_backend="paged", chat_template=TEMPLATE)
    with serve_in_thread(config, model_name="tiny", api_key=KEY) as s:
        yield s


@pytest.fixture
def browser(tmp_path):
    pytest.importorskip("websocket", reason="websocket-client is not installed (pip install -e '.[test]')")
    b = Browser(tmp_path / "profile")
    yield b
    b.close()


def send(browser: Browser, text: str, turn: int) -> dict:
    """Type ``text`` in the chat box, send it, wait for the ``turn``-th answer to finish; its text and figures."""
    browser.js(f"document.getElementById('chat-input').value = {json.dumps(text)}; "
               "document.getElementById('send').click()")
    browser.wait_for(f"document.querySelectorAll('.msg.assistant[data-done]').length >= {turn}")
    return browser.js(f"(() => {{ const a = document.querySelectorAll('.msg.assistant')[{turn - 1}]; "
                      "return {done: a.dataset.done, text: a.querySelector('.content').textContent, "
                      "meta: a.querySelector('.meta').textContent}; })()")


def states(browser: Browser) -> str:
    return browser.js("document.getElementById('pool-map').dataset.states || ''")


@pytest.mark.slow
def test_chat_streams_and_the_pool_map_follows(srv, browser, tmp_path):
    browser.open(srv.url + "/")
    browser.wait_for("!document.getElementById('key-form').hidden")  # 401 from the API: the page asks for the key
    browser.js(f"document.getElementById('api-key').value = {json.dumps(KEY)}; "
               "document.getElementById('key-form').requestSubmit()")
    assert browser.wait_for("document.getElementById('model').textContent === 'tiny' && 'ok'") == "ok"
    empty = browser.wait_for("document.getElementById('pool-map').dataset.states")
    assert set(empty) <= set("fc")
    browser.js("document.getElementById('temperature').value = '0'; document.getElementById('max-tokens').value = '8'")

    first = send(browser, "Tell me about the quick brown fox and the lazy dog, " * 4, 1)
    assert first["done"] == "true" and first["text"], first
    assert "generated" in first["meta"] and "TTFT" in first["meta"] and "prefilled" in first["meta"]
    after_first = browser.wait_for(f"(s => s !== {json.dumps(empty)} && s.includes('c') && s)"
                                   "(document.getElementById('pool-map').dataset.states)")

    second = send(browser, "And then?", 2)  # the whole first turn is the second request's prefix
    assert second["done"] == "true"
    cached = int(second["meta"].split(": ")[1].split(" cached")[0])
    assert cached >= 16, second["meta"]
    browser.wait_for(f"document.getElementById('pool-map').dataset.states !== {json.dumps(after_first)}")
    hits = browser.wait_for("Math.max(0, ...[...document.querySelectorAll('#tree li')].map(li => +li.dataset.hits))")
    assert hits >= 1
    assert "quick brown fox" in browser.js("[...document.querySelectorAll('#tree li')].map(li => li.title).join('')")

    hover = browser.js("(c => { const r = c.getBoundingClientRect(); c.dispatchEvent(new MouseEvent('mousemove', "
                       "{clientX: r.left + 3, clientY: r.top + 3})); return c.title; })"
                       "(document.getElementById('pool-map'))")
    assert hover.startswith("block 1: "), hover

    browser.js("document.getElementById('copy-curl').click()")
    curl = browser.wait_for("document.getElementById('curl').textContent")
    assert curl.startswith("curl -N http://127.0.0.1:") and "/v1/chat/completions" in curl
    assert "$MLXKV_API_KEY" in curl and KEY not in curl and '"stream":true' in curl

    browser.js("document.getElementById('use-schema').click(); document.getElementById('use-tools').click(); "
               "document.getElementById('tool-choice').value = 'required'; document.getElementById('copy-curl').click()")
    assert browser.js("document.getElementById('schema').hidden || document.getElementById('tools').hidden") is False
    curl = browser.js("document.getElementById('curl').textContent")
    assert '"response_format":{"type":"json_schema"' in curl and '"tools":[{"type":"function"' in curl
    assert '"tool_choice":"required"' in curl
    browser.js("document.getElementById('tools').value = '[not json'; document.getElementById('copy-curl').click()")
    assert browser.js("document.getElementById('curl').textContent").startswith("tools: ")

    # an API key's view: its own (unsalted) blocks by name, every other tenant's as "others"; with a cache salt
    # that holds no blocks yet, nothing is the viewer's
    legend = browser.js("document.getElementById('legend').textContent")
    assert "unsalted (you)" in legend and "others" in legend and "t-" not in legend
    browser.js("document.getElementById('cache-salt').value = 'nobody-yet'")
    browser.wait_for("document.getElementById('legend').textContent.includes('others') && "
                     "!document.getElementById('legend').textContent.includes('(you)')")
    browser.js("document.getElementById('cache-salt').value = ''")
    browser.wait_for("document.getElementById('legend').textContent.includes('unsalted (you)')")

    browser.wait_for("document.getElementById('t-pool').textContent.includes('cached')")
    png = browser.screenshot(Path(os.environ.get("MLXKV_TEST_SCREENSHOT", tmp_path / "page.png")))
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (1400, 1000)
    for part in ("chat-input", "messages", "pool-map", "legend", "tree", "plot-tps", "plot-ttft", "t-hit"):
        assert browser.js(f"(e => !!e && e.getBoundingClientRect().width > 0)(document.getElementById('{part}'))"), part
    # drawn, not only laid out: the first cell (a cached block) has a tenant's colour, not the free blocks' grey
    pixels = browser.js("(c => { const x = c.getContext('2d'); const d = x.getImageData(1, 1, 1, 1).data; "
                        "return [Array.from(d), c.width, c.height]; })(document.getElementById('pool-map'))")
    first_cell, width, height = pixels
    assert first_cell[3] > 0 and first_cell[:3] != [232, 232, 237] and width > 100 and height > 10
    assert browser.errors == []
