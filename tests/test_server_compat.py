"""What clients expect beside generation, on a real server on loopback: ``models.retrieve``, CORS, a
``system_fingerprint``, SSE keep-alives during a long wait, ``cached_tokens`` in every usage; the new options of
``serve`` and ``generate`` (``--chat-template``, ``--tool-parser``, ``--allowed-origins``)."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import typer
from typer.testing import CliRunner

from mlxkv.cli.main import app as cli
from mlxkv.cli.serve import serve
from mlxkv.engine.batch import EngineConfig
from mlxkv.server.app import create_app
from mlxkv.server.runner import ServerThread
from testkit.run_config import run_config
from testkit.serve_thread import openai_client, serve_in_thread

pytestmark = pytest.mark.server

ORIGIN = "http://localhost:3000"
PREFLIGHT = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}
QUESTION = [{"role": "user", "content": "What does the with statement do?"}]


@pytest.fixture(scope="module")
def server(llama_dir):
    """One engine (one sequence at a time, so a second request waits) behind the default app."""
    config = run_config(llama_dir, engine=EngineConfig(max_sequences=1, max_queue_depth=8), kv_backend="paged")
    with serve_in_thread(config, model_name="tiny-llama", keepalive_s=0.05) as srv:
        yield srv


def other_app(server, **options):
    """Another app over the same running engine (its own options), served on its own port."""
    return ServerThread(create_app(server.parts.engine, model_name=options.pop("model_name", "tiny-llama"),
                                   **options))


def test_models_retrieve_and_404_for_other_ids(server):
    client = openai_client(server.url)
    model = client.models.retrieve("tiny-llama")
    assert model.id == "tiny-llama" and model.object == "model" and model.owned_by == "mlxkv"
    assert model.created == client.models.list().data[0].created
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("gpt-4o")
    assert exc.value.body["code"] == "model_not_found"
    with other_app(server, model_name="org/tiny-llama.Q4_1") as srv:  # repo ids and file names hold slashes, dots
        assert openai_client(srv.url).models.retrieve("org/tiny-llama.Q4_1").id == "org/tiny-llama.Q4_1"


def test_no_cors_by_default(server):
    assert httpx.options(server.url + "/v1/chat/completions", headers=PREFLIGHT).status_code == 405
    r = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)


def test_cors_preflight_and_headers_for_allowed_origins(server):
    with other_app(server, allowed_origins=[ORIGIN], api_key="s3cret") as srv:
        pre = httpx.options(srv.url + "/v1/chat/completions", headers=PREFLIGHT)  # browsers send no credentials
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        ok = httpx.get(srv.url + "/v1/models", headers={"Origin": ORIGIN, "Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
        denied = httpx.get(srv.url + "/v1/models", headers={"Origin": ORIGIN})
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN  # readable
        other = httpx.options(srv.url + "/v1/chat/completions", headers={**PREFLIGHT, "Origin": "http://evil.test"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    with other_app(server, allowed_origins=["*"]) as srv:
        pre = httpx.options(srv.url + "/v1/completions", headers={**PREFLIGHT, "Origin": "http://any.where"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"


def test_fingerprint_and_cached_tokens_on_every_route_streamed_or_not(server):
    client = openai_client(server.url)
    answers = []
    for _ in range(2):  # the second time the prompt is in the prefix cache
        chat = client.chat.completions.create(model="tiny-llama", messages=QUESTION, max_tokens=2, temperature=0)
        text = client.completions.create(model="tiny-llama", prompt="The with statement", max_tokens=2)
        chat_stream = list(client.chat.completions.create(model="tiny-llama", messages=QUESTION, max_tokens=2,
                                                          stream=True, stream_options={"include_usage": True}))
        text_stream = list(client.completions.create(model="tiny-llama", prompt="The with statement", max_tokens=2,
                                                     stream=True, stream_options={"include_usage": True}))
        answers.append((chat, text, chat_stream[-1], text_stream[-1]))
        fingerprints = {chat.system_fingerprint, text.system_fingerprint}
        fingerprints |= {c.system_fingerprint for c in chat_stream + text_stream}
        assert len(fingerprints) == 1 and fingerprints.pop().startswith("fp_")
    for first, second in zip(*answers):
        assert first.usage.prompt_tokens_details.cached_tokens >= 0
        assert second.usage.prompt_tokens_details.cached_tokens > 0, second.usage
        assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens


def test_a_stream_waiting_for_the_engine_gets_keep_alive_comments(server):
    """With one sequence at a time, a stream sent while another request decodes waits for admission, silent:
    comments go out every 0.05 s; the official client reads the stream through them."""
    busy = threading.Thread(target=lambda: openai_client(server.url).completions.create(
        model="tiny-llama", prompt="The import statement", max_tokens=400, temperature=0))
    busy.start()
    deadline = time.monotonic() + 20
    while server.parts.engine.stats()["running"] == 0:
        assert time.monotonic() < deadline, "the first request never ran"
        time.sleep(0.005)
    lines = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny-llama", "messages": QUESTION, "max_tokens": 3, "stream": True}) as r:
        for line in r.iter_lines():
            lines.append(line)
    busy.join()
    assert lines[-2] == "data: [DONE]" or lines[-1] == "data: [DONE]"
    first_content = next(i for i, line in enumerate(lines) if line.startswith("data: ") and '"content":"' in line
                         and '"role"' not in line)
    assert ": keep-alive" in lines[:first_content], lines[:first_content]

    busy = threading.Thread(target=lambda: openai_client(server.url).completions.create(
        model="tiny-llama", prompt="The import statement", max_tokens=400, temperature=0))
    busy.start()
    while server.parts.engine.stats()["running"] == 0:
        time.sleep(0.005)
    chunks = list(openai_client(server.url).chat.completions.create(model="tiny-llama", messages=QUESTION, max_tokens=3,
                                                                 stream=True, temperature=0))
    busy.join()
    direct = openai_client(server.url).chat.completions.create(model="tiny-llama", messages=QUESTION, max_tokens=3,
                                                            temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == direct.choices[0].message.content


def test_serve_options_fail_cleanly(tmp_path, llama_dir):
    app = typer.Typer()
    app.command()(serve)
    runner = CliRunner()
    cases = [(["--tool-parser", "nope"], "unknown tool parser 'nope': expected one of", 1),
             (["--chat-template", str(tmp_path / "missing.jinja")], "no such file", 2),  # the parser's check
             (["--allowed-origins", "localhost"], "is not an origin", 2)]  # an option error
    for args, message, code in cases:
        result = runner.invoke(app, ["--model", llama_dir, "--port", "1", *args])
        assert result.exit_code == code and message in result.output, (args, result.output)
    assert all(o in runner.invoke(app, ["--help"]).output
               for o in ("--chat-template", "--tool-parser", "--allowed-origins", "--sse-keepalive-s"))


def test_generate_renders_with_the_chat_template_file(tmp_path, llama_dir):
    template = tmp_path / "qa.jinja"
    template.write_text("{{ bos_token }}{% for m in messages %}Q: {{ m.content }}\n{% endfor %}A:")  # raw adds BOS
    runner = CliRunner()
    templated = runner.invoke(cli, ["generate", "-m", llama_dir, "--chat-template", str(template), "-n", "8",
                                    "Lists are mutable"])
    raw = runner.invoke(cli, ["generate", "-m", llama_dir, "--raw", "-n", "8", "Q: Lists are mutable\nA:"])
    assert templated.exit_code == 0 and raw.exit_code == 0, templated.output + raw.output
    assert templated.stdout == raw.stdout and templated.stdout.strip()


def test_a_messages_stream_waiting_for_the_engine_gets_ping_events(server):
    """The Anthropic stream's keep-alive is its own ``ping`` event: more than the one it opens with when the
    request waits for admission behind another."""
    busy = threading.Thread(target=lambda: openai_client(server.url).completions.create(
        model="tiny-llama", prompt="The import statement", max_tokens=400, temperature=0))
    busy.start()
    deadline = time.monotonic() + 20
    while server.parts.engine.stats()["running"] == 0:
        assert time.monotonic() < deadline, "the first request never ran"
        time.sleep(0.005)
    with httpx.stream("POST", server.url + "/v1/messages", timeout=60,
                      json={"model": "tiny-llama", "messages": QUESTION, "max_tokens": 3, "stream": True}) as r:
        kinds = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    busy.join()
    first_delta = kinds.index("content_block_delta")
    assert kinds[:first_delta].count("ping") > 1, kinds
    assert kinds[-1] == "message_stop"
