"""Without the vision extra (mlx-vlm), a vision-language checkpoint serves text exactly as before and refuses an image
naming the extra; a text-only model refuses an image on both routes. Runs whether or not mlx-vlm is installed (its
absence is simulated)."""

from __future__ import annotations

import base64

import pytest

from testkit.run_config import run_config
from testkit.serve_thread import anthropic_client, openai_client, serve_in_thread
from testkit.vlm import write_gemma3_language_only

pytestmark = pytest.mark.server

#: A 1x1 PNG: nothing here decodes it (the refusals come first), so Pillow need not be installed.
PNG = base64.b64decode("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC")
IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(PNG).decode()}}


def test_a_vlm_without_mlx_vlm_serves_text_and_names_the_extra(tmp_path, monkeypatch):
    import openai

    import mlxkv.vision.inputs

    monkeypatch.setattr(mlxkv.vision.inputs, "mlx_vlm_available", lambda: False)
    path = write_gemma3_language_only(tmp_path / "gemma3")
    with serve_in_thread(run_config(str(path), kv_backend="paged")) as srv:
        client = openai_client(srv.url)
        with pytest.raises(openai.BadRequestError, match=r'mlx-vlm, which is not installed: pip install "mlxkv\[vision\]"'):
            client.chat.completions.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [IMAGE_PART]}])
        text = client.chat.completions.create(model="m", max_tokens=6, temperature=0,
                                              messages=[{"role": "user", "content": "Hello there"}])
        assert text.choices[0].message.content and "vision" not in srv.parts.engine.stats()


def test_text_only_model_refuses_an_image(served):
    import anthropic
    import openai

    with pytest.raises(openai.BadRequestError, match="reads text only"):
        openai_client(served().url).chat.completions.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": [IMAGE_PART]}])
    with pytest.raises(anthropic.BadRequestError, match="reads text only"):
        anthropic_client(served().url).messages.create(model="m", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(PNG).decode()}}]}])
