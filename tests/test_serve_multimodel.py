"""Several models behind one server (``mlxkv serve -m A -m B``): each request's ``model`` picks one, through the
official clients on loopback; the least recently used idle model unloads under ``--max-loaded-models``; an unknown
model is a 404 in each API's shape; the CLI refuses bad model lists in one line."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import threading
import time
import weakref

import anthropic
import httpx
import openai
import pytest
from mlxkv.cli.main import app
from testkit.run_config import run_config
from testkit.serve_signals import Server
from testkit.serve_thread import anthropic_client, openai_client, serve_in_thread, serve_models_in_thread
from typer.testing import CliRunner

from mlxkv.config import EngineConfig

pytestmark = pytest.mark.server

QUESTION = [{"role": "user", "content": "Which way to the station?"}]
runner = CliRunner()
BUDGET = 4 * 1024 * 1024  # bytes of KV per model: the tiny models need little, and the pools build fast


def _config():
    return run_config(engine=EngineConfig(max_sequences=4, max_queue_depth=16), kv_backend="paged",
                      kv_cache_budget=BUDGET)


@pytest.fixture(scope="module")
def folders(test_model_dir):
    """Two test llamas whose different weights answer differently: ``a`` and ``b``."""
    return {"a": str(test_model_dir("llama", 0)), "b": str(test_model_dir("llama", 1))}


def _chat(url: str, model: str) -> str:
    r = openai_client(url).chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0)
    return r.choices[0].message.content


def _message(url: str, model: str) -> str:
    r = anthropic_client(url).messages.create(model=model, messages=QUESTION, max_tokens=8,
                                           extra_body={"temperature": 0})
    return r.content[0].text


@pytest.fixture(scope="module")
def alone(folders, served):
    """Each model's greedy answers when served alone (chat, then messages): ``a`` is the run's shared test llama."""
    answers = {"a": (_chat(served().url, "a"), _message(served().url, "a"))}
    config = _config()
    config.model = folders["b"]
    with serve_in_thread(config, model_name="b") as srv:
        answers["b"] = (_chat(srv.url, "b"), _message(srv.url, "b"))
    assert answers["a"] != answers["b"]  # the two models tell themselves apart
    return answers


@pytest.fixture(scope="module")
def both(folders):
    """``a`` and ``b`` behind one server, both allowed to stay loaded."""
    with serve_models_in_thread(_config(), list(folders.items())) as srv:
        yield srv


def test_both_models_answer_concurrently_with_their_own_tokens(both, alone):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = {(name, kind): pool.submit(call, both.url, name)
                for name in ("a", "b") for kind, call in (("chat", _chat), ("message", _message))}
        got = {key: job.result() for key, job in jobs.items()}
    for name in ("a", "b"):
        assert (got[name, "chat"], got[name, "message"]) == alone[name]
    models = openai_client(both.url).models.list().data
    assert [(m.id, m.state) for m in models] == [("a", "loaded"), ("b", "loaded")]
    engines = {slot.served.engine for slot in both.registry.slots.values()}
    assert len(engines) == 2 and len({id(e.pool) for e in engines}) == 2  # an engine and a pool each


def test_a_request_without_a_model_goes_to_the_first(both, alone):
    r = httpx.post(both.url + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == alone["a"][0]


def test_cache_routes_and_metrics_describe_the_model_asked_for(both):
    def stats() -> dict:
        return {m: httpx.get(both.url + "/v1/cache/stats", params={"model": m}).json() for m in ("a", "b")}

    def prompt_tokens(model: str) -> float:
        text = httpx.get(both.url + "/metrics", params={"model": model}).text
        return float(next(line.split()[1] for line in text.splitlines()
                          if line.startswith("mlxkv_prompt_tokens_total ")))

    before, metered = stats(), {m: prompt_tokens(m) for m in ("a", "b")}
    _chat(both.url, "b")
    after = stats()
    assert after["a"]["prompt_tokens_total"] == before["a"]["prompt_tokens_total"]
    assert after["b"]["prompt_tokens_total"] > before["b"]["prompt_tokens_total"]
    assert httpx.get(both.url + "/v1/cache/stats").json()["prompt_tokens_total"] == \
        after["a"]["prompt_tokens_total"]  # the first model by default
    assert prompt_tokens("a") == metered["a"] and prompt_tokens("b") == after["b"]["prompt_tokens_total"]
    blocks = {m: httpx.get(both.url + "/v1/cache/blocks", params={"model": m}).json() for m in ("a", "b")}
    assert blocks["a"]["paged"] and blocks["b"]["paged"] and blocks["a"] != blocks["b"]


def test_cache_stats_and_top_read_the_model_named(both):
    _chat(both.url, "b")
    read = {}
    for model in ("a", "b"):
        result = runner.invoke(app, ["cache", "stats", "--url", both.url, "--model", model, "--json"])
        assert result.exit_code == 0, result.output
        read[model] = json.loads(result.stdout)["prompt_tokens_total"]
        assert read[model] == httpx.get(both.url + "/v1/cache/stats", params={"model": model}).json()[
            "prompt_tokens_total"]
    assert read["a"] != read["b"]
    result = runner.invoke(app, ["top", "--url", both.url, "--model", "b", "--once", "--json", "--interval", "0.1"])
    assert result.exit_code == 0 and json.loads(result.stdout)["pool"]["paged"], result.output
    result = runner.invoke(app, ["top", "--url", both.url, "--model", "nope", "--once"])
    assert result.exit_code == 1 and "no model 'nope'" in result.stderr and result.stderr.count("\n") == 1


def test_a_stored_response_is_found_with_the_model_that_made_it(both):
    client = openai_client(both.url)
    made = client.responses.create(model="b", input="Which way to the station?", max_output_tokens=4,
                                   temperature=0)
    assert client.responses.retrieve(made.id).model == "b"
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)


def test_the_page_and_the_api_description_are_served(both):
    page = httpx.get(both.url + "/")
    assert page.status_code == 200 and 'id="model-pick"' in page.text
    paths = httpx.get(both.url + "/openapi.json").json()["paths"]
    assert {"/v1/chat/completions", "/v1/messages", "/v1/cache/stats"} <= set(paths)


def test_an_unknown_model_is_a_404_in_each_api_shape(both):
    client = openai_client(both.url)
    with pytest.raises(openai.NotFoundError, match="no model 'nope' here: this server serves 'a', 'b'"):
        client.chat.completions.create(model="nope", messages=QUESTION, max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="no model 'nope'"):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="no model 'nope'"):
        client.responses.create(model="nope", input="x", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    with pytest.raises(anthropic.NotFoundError, match="no model 'nope'") as caught:
        anthropic_client(both.url).messages.create(model="nope", messages=QUESTION, max_tokens=2)
    assert caught.value.body["error"]["type"] == "not_found_error"
    wrong = httpx.get(both.url + "/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    for path in ("/v1/cache/stats", "/v1/cache/blocks", "/metrics"):
        r = httpx.get(both.url + path, params={"model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", path


def test_the_least_recently_used_idle_model_unloads_and_reloads_with_the_same_tokens(folders, alone):
    with serve_models_in_thread(_config(), list(folders.items()), max_loaded=1) as srv:
        registry = srv.registry
        weights = weakref.ref(registry.slots["a"].served.loaded.model)
        states = lambda: {m.id: m.state for m in openai_client(srv.url).models.list().data}  # noqa: E731
        assert states() == {"a": "loaded", "b": "not-loaded"}
        stream = openai_client(srv.url).chat.completions.create(model="a", messages=QUESTION, max_tokens=48,
                                                                temperature=0, stream=True)
        chunks = [next(iter(stream))]  # a is answering: b waits until a is idle
        answered: list[tuple[str, float]] = []
        other = threading.Thread(target=lambda: answered.append((_message(srv.url, "b"), time.monotonic())))
        other.start()
        chunks += list(stream)  # an unload under it would end the stream with an error, which the client raises
        a_done = time.monotonic()
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        other.join(60)
        assert answered[0][0] == alone["b"][1] and answered[0][1] > a_done
        assert states() == {"a": "not-loaded", "b": "loaded"} and len(registry.loaded()) == 1
        assert weights() is None  # a's weights, engine and pool are gone, not merely unlisted
        r = httpx.get(srv.url + "/v1/cache/stats", params={"model": "a"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "model_not_loaded"
        assert _chat(srv.url, "a") == alone["a"][0]  # loaded again on demand
        assert states() == {"a": "loaded", "b": "not-loaded"} and registry.slots["a"].loads == 2


def test_a_model_that_fails_to_load_is_a_503_and_the_others_answer(folders, tmp_path, alone):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    with serve_models_in_thread(_config(), [("a", folders["a"]), ("broken", str(broken))]) as srv:
        with pytest.raises(openai.InternalServerError, match="model 'broken' could not be loaded") as caught:
            openai_client(srv.url).chat.completions.create(model="broken", messages=QUESTION, max_tokens=2)
        assert caught.value.status_code == 503 and caught.value.body["code"] == "model_load_failed"
        assert srv.registry.slots["broken"].state == "not-loaded"
        assert _chat(srv.url, "a") == alone["a"][0]


def test_an_unauthenticated_request_loads_nothing(folders):
    with serve_models_in_thread(_config(), list(folders.items()), api_key="k3y") as srv:
        with pytest.raises(openai.AuthenticationError):
            openai_client(srv.url, api_key="wrong").chat.completions.create(model="b", messages=QUESTION,
                                                                            max_tokens=2)
        assert srv.registry.slots["b"].state == "not-loaded"
        assert _chat_with_key(srv.url, "b", "k3y")
        assert srv.registry.slots["b"].state == "loaded"


def _chat_with_key(url: str, model: str, key: str) -> str:
    r = openai_client(url, api_key=key).chat.completions.create(model=model, messages=QUESTION, max_tokens=2)
    return r.choices[0].message.content


@pytest.mark.slow
def test_serve_process_logs_loads_and_unloads_and_keeps_a_tier_folder_per_model(folders, tmp_path):
    tier = tmp_path / "tier"
    srv = Server("-m", f"a={folders['a']}", "-m", f"b={folders['b']}", "--max-loaded-models", "1",
                 "--kv-cache-budget", "4MB", "--kv-disk-cache", str(tier), "--log-level", "info")
    ended: list[str] = []

    def answer_at_length() -> None:
        stream = srv.client.chat.completions.create(model="a", messages=QUESTION, max_tokens=400, temperature=0,
                                                    stream=True)
        try:
            for _ in stream:
                started.set()
        except openai.APIError as exc:
            ended.append(str(exc))

    started = threading.Event()
    try:
        for model in ("b", "a"):
            srv.client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4)
        streaming = threading.Thread(target=answer_at_length)
        streaming.start()
        assert started.wait(60)
    finally:
        code, out = srv.stop(signal.SIGTERM)
    streaming.join(30)
    assert code == 0, out
    assert ended and "shutting down" in ended[0]  # the open answer ended by the stop, not cut off
    assert "mlxkv serve: 2 models on" in out and "a (loaded), b (not-loaded)" in out
    for line in ("loading model 'b'", "unloading model 'a'", "model 'b' unloaded", "model 'a' loaded in"):
        assert line in out, out
    assert "KV tier of a saved" in out
    assert sorted(p.name for p in tier.iterdir() if p.is_dir()) == ["a", "b"]



@pytest.mark.parametrize("args, fragment", [
    (["-m", "x={a}", "-m", "x={b}"], "two models are served as 'x'"),
    (["-m", "{a}", "-m", "{a}"], "two models are served as 'llama-seed0'"),
    (["-m", "{a}", "-m", "{b}", "--max-loaded-models", "0"], "--max-loaded-models"),
    (["-m", "{a}", "-m", "{b}", "--served-model-name", "x"], "--served-model-name applies to one model"),
    (["-m", "{a}", "-m", "{b}", "--revision", "main"], "--revision applies to one model"),
    (["-m", "{a}", "-m", "{b}", "--distributed", "tensor"], "--distributed serves one model"),
    (["-m", "{a}", "-m", "{b}", "--adapter-path", "{adapter}"], "--adapter-path applies to one model"),
    (["-m", "=x"], "expected NAME=MODEL"),
    (["-m", "x={a}", "--served-model-name", "y"], "named twice"),
    (["-m", "{a}", "--models-file", "{empty}"], "no model in it"),
    (["-m", "{a}", "--models-file", "{missing}"], "no such file"),
    (["-m", "{a}", "-m", "{missing}"], "model not found"),
])
def test_bad_model_lists_are_one_line_errors(folders, tmp_path, args, fragment):
    empty = tmp_path / "models.txt"
    empty.write_text("# nothing yet\n\n")
    values = {"a": folders["a"], "b": folders["b"], "empty": str(empty), "missing": str(tmp_path / "nowhere"),
              "adapter": str(tmp_path / "adapter")}
    if "--adapter-path" in args:
        from testkit.adapters import write_test_adapter

        write_test_adapter(folders["a"], tmp_path / "adapter")
    result = runner.invoke(app, ["serve", *(a.format(**values) for a in args), "--port", "0"])
    assert result.exit_code in (1, 2), result.output
    assert result.stderr.strip().count("\n") == 0 and result.stderr.startswith("error:"), result.stderr
    assert fragment in result.stderr


def test_model_names_come_from_name_equals_else_the_folder_or_file(tmp_path):
    from mlxkv.cli.served_models import named, served_models

    folder, gguf = tmp_path / "Qwen2.5-0.5B", tmp_path / "SmolLM2-135M.Q4_1.gguf"
    folder.mkdir()
    gguf.write_bytes(b"GGUF")
    listed = tmp_path / "models.txt"
    listed.write_text(f"# served too\nextra={folder}  # a comment\n")
    pairs = served_models([str(folder), str(gguf), "org/repo@v1", f"mine={gguf}"], str(listed))
    assert named(pairs) == [("Qwen2.5-0.5B", str(folder)), ("SmolLM2-135M.Q4_1", str(gguf)),
                            ("org/repo@v1", "org/repo@v1"), ("mine", str(gguf)), ("extra", str(folder))]


@pytest.mark.slow
def test_the_page_picks_a_model_and_follows_it(folders, alone, tmp_path):
    pytest.importorskip("websocket", reason="websocket-client is not installed (pip install -e '.[test]')")
    from testkit.browser import CHROMIUM, Browser

    if CHROMIUM is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    with serve_models_in_thread(_config(), list(folders.items()), max_loaded=1) as srv:
        browser = Browser(tmp_path / "profile")
        try:
            browser.open(srv.url + "/")
            labels = "[...document.getElementById('model-pick').options].map(o => o.text).join(',')"
            assert browser.wait_for(f"!document.getElementById('model-pick').hidden && {labels}") == \
                "a,b (not-loaded)"
            browser.js("const p = document.getElementById('model-pick'); p.value = 'b'; "
                       "p.dispatchEvent(new Event('change')); "
                       "document.getElementById('temperature').value = '0'; "
                       "document.getElementById('max-tokens').value = '8'; "
                       f"document.getElementById('chat-input').value = {json.dumps(QUESTION[0]['content'])}; "
                       "document.getElementById('send').click()")
            browser.wait_for("document.querySelectorAll('.msg.assistant[data-done]').length >= 1")
            text = browser.js("document.querySelector('.msg.assistant .content').textContent")
            assert text == alone["b"][0]
            assert browser.wait_for(f"({labels}) === 'a (not-loaded),b' && 'ok'") == "ok"  # the picker follows
            states = browser.wait_for("document.getElementById('pool-map').dataset.states")
            assert "c" in states  # b's pool map, with b's cached prompt
            assert not browser.errors, browser.errors
        finally:
            browser.close()
