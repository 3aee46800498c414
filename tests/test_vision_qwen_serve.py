"""A tiny random Qwen2-VL through every door: `mlxkv serve` (OpenAI chat ``image_url`` parts, Anthropic ``image``
blocks, Responses ``input_image`` parts), `mlxkv generate --image` and `mlxkv chat`'s ``/image``. A second question
about the same image reports its tokens cached and answers as a fresh request; the doors answer alike, and as
mlx-vlm's own generate."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason='needs the vision extra: pip install "mlxkv[vision]"')

from testkit.run_config import run_config  # noqa: E402
from testkit.serve_thread import anthropic_client, openai_client, serve_in_thread  # noqa: E402
from testkit.vlm import write_qwen_vl  # noqa: E402

pytestmark = pytest.mark.server
IMAGE_TOKENS = 20  # a 40 x 32 picture: a 5 x 4 grid of tokens


def png(seed: int = 0) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray((np.random.default_rng(seed).random((40, 32, 3)) * 255).astype("uint8")).save(out, "PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return write_qwen_vl(tmp_path_factory.mktemp("vlm") / "qwen2_vl", seed=0)


@pytest.fixture(scope="module")
def srv(vlm_dir):
    from mlxkv.config import EngineConfig

    with serve_in_thread(run_config(str(vlm_dir), engine=EngineConfig(max_sequences=2), kv_backend="paged",
                                    kv_block_size=4)) as server:
        yield server


def ask(srv, image: bytes, question: str, salt: str | None = None, max_tokens: int = 10):
    r = openai_client(srv.url).chat.completions.create(
        model="m", max_tokens=max_tokens, temperature=0, extra_body={"cache_salt": salt} if salt else None,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                               {"type": "text", "text": question}]}])
    return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens


def test_second_question_reuses_the_image_and_the_three_apis_answer_alike(srv):
    first, cached = ask(srv, png(1), "Describe it.")
    assert cached == 0 and first
    second, cached = ask(srv, png(1), "What colour is it?")
    assert cached >= IMAGE_TOKENS and second == ask(srv, png(1), "What colour is it?", salt="fresh")[0]

    msg = anthropic_client(srv.url).messages.create(
        model="m", max_tokens=10, extra_body={"temperature": 0},
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(1)).decode()}},
            {"type": "text", "text": "Describe it."}]}])
    assert msg.content[0].text == first and msg.usage.cache_read_input_tokens >= IMAGE_TOKENS

    client = openai_client(srv.url)
    r = client.responses.create(model="m", max_output_tokens=10, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(png(1))},
                                     {"type": "input_text", "text": "Describe it."}]}])
    assert r.output_text == first and r.usage.input_tokens_details.cached_tokens >= IMAGE_TOKENS


def test_responses_input_image_refusals(srv, tmp_path):
    def post(content, **extra):
        return httpx.post(srv.url + "/v1/responses", json={"model": "m", "max_output_tokens": 2, **extra,
                                                           "input": [{"role": "user", "content": content}]})

    bad = post([{"type": "input_image", "image_url": data_url(b"not an image")}])
    assert bad.status_code == 400 and "not an image" in bad.json()["error"]["message"]
    local = post([{"type": "input_image", "image_url": f"file://{tmp_path}/p.png"}])
    assert local.status_code == 400 and "file:// image URLs are off" in local.json()["error"]["message"]
    stored = post([{"type": "input_image", "image_url": data_url(png(2))}, {"type": "input_text", "text": "Hi"}])
    assert stored.status_code == 200, stored.text
    follow = httpx.post(srv.url + "/v1/responses", json={"model": "m", "input": "And then?",
                                                          "previous_response_id": stored.json()["id"]})
    assert follow.status_code == 400 and follow.json()["error"]["param"] == "previous_response_id"


def test_generate_image_answers_as_serve(vlm_dir, srv, tmp_path):
    from typer.testing import CliRunner

    from mlxkv.cli.main import app

    picture = tmp_path / "picture.png"
    picture.write_bytes(png(3))
    result = CliRunner().invoke(app, ["generate", "-m", str(vlm_dir), "--chat", "--temp", "0", "-n", "10",
                                      "--image", str(picture), "Describe it."])
    assert result.exit_code == 0, result.output
    answer = ask(srv, png(3), "Describe it.")[0]
    assert result.stdout.strip() == answer.strip() and answer.strip()
    assert answer == mlx_vlm_answer(vlm_dir, png(3), "Describe it.", 10)


def mlx_vlm_answer(path, image: bytes, question: str, max_tokens: int) -> str:
    """mlx-vlm's own greedy answer for the chat turn ``image`` then ``question`` (the reference)."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step
    from mlx_vlm.utils import load_model

    from mlxkv.models import load
    from mlxkv.vision.images import decode_image
    from mlxkv.vision.inputs import RequestImages, VisionInputs

    loaded = load(str(path))
    vision = VisionInputs.for_model(path, loaded.config, loaded.tokenizer, model=loaded.model)
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": vision.marker + question}],
                                               add_generation_prompt=True)
    decoded = decode_image(image)
    prompt, _ = vision.expand(ids, RequestImages([decoded], (None,)))
    pixels = vision.encoder.pixels(decoded.image)
    steps = generate_step(mx.array(prompt)[None], load_model(path), mx.array(pixels.values), None,
                          max_tokens=max_tokens, temperature=0.0, image_grid_thw=mx.array([pixels.grid]))
    tokens = [int(t) for t, _ in steps]
    return loaded.tokenizer.decode(tokens[: tokens.index(2)] if 2 in tokens else tokens)


@pytest.mark.slow
def test_chat_image_command_answers_as_serve_and_reuses_the_image(vlm_dir, srv, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    picture = tmp_path / "p.png"
    picture.write_bytes(png(4))
    lines = "\n".join([f"/image {picture}", "Describe it.", "/stats", "And its colour?", "/stats", "/exit"]) + "\n"
    env = {**os.environ, "PYTHONPATH": str(root), "MLXKV_SESSIONS_DIR": str(tmp_path / "sessions"), "COLUMNS": "300"}
    done = subprocess.run([sys.executable, "-m", "mlxkv", "chat", "-m", str(vlm_dir), "-n", "8"], input=lines,
                          capture_output=True, text=True, env=env, cwd=root, timeout=120)
    assert done.returncode == 0, done.stderr
    first = done.stdout.splitlines()[0]
    assert first == ask(srv, png(4), "Describe it.", max_tokens=8)[0]
    cached = [int(line.split(" cached")[0].rsplit(", ", 1)[1]) for line in done.stderr.splitlines()
              if line.startswith("last turn:")]
    assert cached[0] == 0 and cached[1] > IMAGE_TOKENS  # the second message reuses the image's tokens
