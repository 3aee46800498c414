"""Images through `mlxkv serve` (OpenAI ``image_url`` parts, Anthropic ``image`` blocks) on a tiny random Gemma 3 VLM:
image-aware prefix caching (greedy output with reuse equals a fresh server's; one changed pixel or another UUID
misses), the feature cache, KV events naming the images, and the 400s for bad images."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason='needs the vision extra: pip install "mlxkv[vision]"')

from testkit.run_config import run_config  # noqa: E402
from testkit.serve_thread import anthropic_client, openai_client, serve_in_thread  # noqa: E402
from testkit.vlm import write_gemma3_vlm  # noqa: E402

pytestmark = pytest.mark.server


def png(seed: int = 0, poke: bool = False) -> bytes:
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((20, 24, 3)) * 255).astype("uint8")
    if poke:
        pixels[3, 5, 0] ^= 1  # one pixel, one bit
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return write_gemma3_vlm(tmp_path_factory.mktemp("vlm") / "gemma3", seed=0)


def _server(vlm_dir, **build):
    from mlxkv.config import EngineConfig

    return serve_in_thread(run_config(str(vlm_dir), engine=EngineConfig(max_sequences=2), kv_backend="paged",
                                      kv_block_size=4), **build)


@pytest.fixture(scope="module")
def srv(vlm_dir):
    """One server for the module: each test uses images of its own and compares counters before and after."""
    with _server(vlm_dir) as server:
        yield server


def ask(srv, image: bytes, question: str, uuid: str | None = None, max_tokens: int = 10, salt: str | None = None):
    extra = {"multi_modal_uuids": {"image": [uuid]}} if uuid else {}
    if salt:
        extra["cache_salt"] = salt  # a salt of its own: nothing cached is shared, the answer is computed afresh
    r = openai_client(srv.url).chat.completions.create(
        model="m", max_tokens=max_tokens, temperature=0, extra_body=extra,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                               {"type": "text", "text": question}]}])
    return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def vision_stats(srv) -> dict:
    return srv.parts.engine.stats()["vision"]


def test_second_question_reuses_the_image_and_answers_as_without_reuse(srv):
    image = png(0)
    before = vision_stats(srv)
    first = ask(srv, image, "What is in this picture?")
    again = ask(srv, image, "What colour is it?")
    fresh = ask(srv, image, "What colour is it?", salt="elsewhere")
    assert again[0] == fresh[0] and first[0]  # reuse changes nothing in the greedy answer
    assert first[2] == 0 and fresh[2] == 0 and again[2] >= 16  # the image's 16 tokens came from the cache
    stats = vision_stats(srv)
    # a prefix hit over the image never asks for its features; the first and the salted request did
    assert stats["encoder_cache_misses"] - before["encoder_cache_misses"] == 1
    assert stats["encoder_cache_hits"] - before["encoder_cache_hits"] == 1
    assert stats["image_tokens"] - before["image_tokens"] == 48
    assert stats["image_tokens_cached"] - before["image_tokens_cached"] == 16
    assert ask(srv, png(0, poke=True), "What colour is it?")[2] < 16  # one changed pixel misses
    assert ask(srv, image, "What colour is it?", uuid="photo-1")[2] < 16  # a UUID keys another entry
    assert ask(srv, image, "What colour is it?", uuid="photo-1")[2] >= 16
    metrics = httpx.get(srv.url + "/metrics").text
    assert f"mlxkv_image_tokens_cached_total {float(vision_stats(srv)['image_tokens_cached'])}" in metrics
    events = httpx.get(srv.url + "/v1/cache/events").json()["events"]
    labels = {label for e in events for label in e.get("images", ())}
    assert "photo-1" in labels and image_hash(image) in labels and image_hash(png(0, poke=True)) in labels


def image_hash(data: bytes) -> str:
    from mlxkv.vision.images import decode_image

    return decode_image(data).content_hash


def test_anthropic_image_block_matches_the_openai_door(srv):
    image = png(1)
    via_openai = ask(srv, image, "Describe it.")
    msg = anthropic_client(srv.url).messages.create(
        model="m", max_tokens=10, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(image).decode()}},
            {"type": "text", "text": "Describe it."}]}])
    assert msg.content[0].text == via_openai[0]
    assert msg.usage.cache_read_input_tokens >= 16
    counted = anthropic_client(srv.url).messages.count_tokens(model="m", messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": base64.b64encode(image).decode()}},
        {"type": "text", "text": "Describe it."}]}])
    assert counted.input_tokens == via_openai[1]  # the image's placeholders counted, as the prompt holds them


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not an image"),
    ("https://example.com/cat.png", "not fetched"),
    ("file:///etc/passwd", "file:// image URLs are off"),
    ("data:image/png;base64,@@@", "not valid base64"),
])
def test_bad_images_are_400(srv, url, message):
    import openai

    with pytest.raises(openai.BadRequestError, match=message):
        openai_client(srv.url).chat.completions.create(
            model="m", max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])


def test_generate_image_answers_as_serve(vlm_dir, srv, tmp_path):
    from typer.testing import CliRunner

    from mlxkv.cli.main import app

    picture = tmp_path / "picture.png"
    picture.write_bytes(png(2))
    runner = CliRunner()
    result = runner.invoke(app, ["generate", "-m", str(vlm_dir), "--chat", "--temp", "0", "-n", "10", "--image",
                                 str(picture), "Describe it."])
    assert result.exit_code == 0, result.output
    answer = ask(srv, png(2), "Describe it.")[0]
    assert result.stdout.strip() == answer.strip() and answer.strip()
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not an image")
    result = runner.invoke(app, ["generate", "-m", str(vlm_dir), "--chat", "--image", str(bad), "Hi"])
    assert result.exit_code != 0 and "not an image" in result.output


def test_file_urls_read_only_the_allowed_folder(vlm_dir, srv, tmp_path):
    import openai

    from mlxkv.vision.images import ImageLimits

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "p.png").write_bytes(png(3))
    (tmp_path / "outside.png").write_bytes(png(3))
    by_data = ask(srv, png(3), "Describe it.")[0]
    with _server(vlm_dir, image_limits=ImageLimits(allowed_dirs=(allowed,))) as own:
        def by_file(path):
            return openai_client(own.url).chat.completions.create(
                model="m", max_tokens=10, temperature=0,
                messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": f"file://{path}"}},
                                                       {"type": "text", "text": "Describe it."}]}])

        assert by_file(allowed / "p.png").choices[0].message.content == by_data
        for outside in (tmp_path / "outside.png", allowed / ".." / "outside.png"):
            with pytest.raises(openai.BadRequestError, match="outside the folders"):
                by_file(outside)


def test_serve_refuses_an_allowed_image_dir_that_is_not_a_folder(tmp_path):
    from typer.testing import CliRunner

    from mlxkv.cli.main import app

    result = CliRunner().invoke(app, ["serve", "--allowed-image-dir", str(tmp_path / "missing")])
    assert result.exit_code != 0 and "is not a folder" in result.output


def test_generate_without_mlx_vlm_names_the_extra(vlm_dir, monkeypatch, tmp_path):
    from typer.testing import CliRunner

    import mlxkv.vision.inputs
    from mlxkv.cli.main import app

    monkeypatch.setattr(mlxkv.vision.inputs, "mlx_vlm_available", lambda: False)
    picture = tmp_path / "p.png"
    picture.write_bytes(png())
    result = CliRunner().invoke(app, ["generate", "-m", str(vlm_dir), "--chat", "--image", str(picture), "Hi"])
    assert result.exit_code != 0 and 'pip install "mlxkv[vision]"' in result.output


def test_multi_turn_about_one_image_reuses_it_and_answers_as_without_reuse(srv):
    image = data_url(png(4))
    turn = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": "What is this?"}]}]
    client = openai_client(srv.url)

    def answer(messages, salt=None):
        r = client.chat.completions.create(model="m", max_tokens=8, temperature=0, messages=messages,
                                           extra_body={"cache_salt": salt} if salt else None)
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens

    first, _ = answer(turn)
    follow = turn + [{"role": "assistant", "content": first}, {"role": "user", "content": "And its colour?"}]
    second, cached = answer(follow)
    assert cached >= 16 and second == answer(follow, salt="fresh")[0]


def test_too_many_too_large_and_mismatched_uuids_are_400(vlm_dir, srv):
    import openai

    from mlxkv.vision.images import ImageLimits

    def parts(n, seed=5):
        return [{"type": "image_url", "image_url": {"url": data_url(png(seed))}}] * n + [{"type": "text", "text": "?"}]

    client = openai_client(srv.url)
    with pytest.raises(openai.BadRequestError, match="9 images in one request, over the limit of 8"):
        client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": parts(9)}])
    with pytest.raises(openai.BadRequestError, match="2 entries for 1 images"):
        client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": parts(1)}],
                                       extra_body={"multi_modal_uuids": {"image": ["a", "b"]}})
    with pytest.raises(openai.BadRequestError, match="holds 2 image markers for 1 images"):
        client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
            *parts(1), {"type": "text", "text": "<start_of_image>"}]}])
    with _server(vlm_dir, image_limits=ImageLimits(max_bytes=100)) as small:
        with pytest.raises(openai.BadRequestError, match="over the limit of 100"):
            openai_client(small.url).chat.completions.create(model="m", max_tokens=2,
                                                             messages=[{"role": "user", "content": parts(1)}])


@pytest.mark.slow  # a `mlxkv chat` process importing mlx-vlm: ~10 s on 2 cores
def test_chat_image_command_answers_as_serve_and_reuses_the_image(vlm_dir, srv, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    picture = tmp_path / "p.png"
    picture.write_bytes(png(6))
    (tmp_path / "bad.png").write_bytes(b"not an image")
    lines = "\n".join([f"/image {tmp_path / 'bad.png'}", f"/image {picture}", "Describe it.", "/stats",
                       "And its colour?", "/stats", "/save s", "/exit"]) + "\n"
    env = {**os.environ, "PYTHONPATH": str(root), "MLXKV_SESSIONS_DIR": str(tmp_path / "sessions"), "COLUMNS": "300"}
    done = subprocess.run([sys.executable, "-m", "mlxkv", "chat", "-m", str(vlm_dir), "-n", "8"], input=lines,
                          capture_output=True, text=True, env=env, cwd=root, timeout=120)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first == ask(srv, png(6), "Describe it.", max_tokens=8)[0]
    assert "error: the image data is not an image" in done.stderr
    cached = [int(line.split(" cached")[0].rsplit(", ", 1)[1]) for line in done.stderr.splitlines()
              if line.startswith("last turn:")]
    assert cached[0] == 0 and cached[1] > 16  # the second message reuses the image's tokens
    assert "error: a conversation holding images cannot be saved" in done.stderr
