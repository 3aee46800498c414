"""Image prompts in the engine against references: mlx-vlm's own forward of the same VLM (greedy tokens equal, first
logits close), prefill chunks that split an image, and preemption under a tiny paged pool (every request still
equals its unpreempted answer)."""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason='needs the vision extra: pip install "mlxkv[vision]"')

from testkit.vlm import BOI_ID, write_gemma3_vlm  # noqa: E402

from mlxkv.config import EngineConfig, KvCacheConfig  # noqa: E402
from mlxkv.engine.batch import BatchEngine  # noqa: E402
from mlxkv.engine.direct import DirectEngine  # noqa: E402
from mlxkv.engine.request import GenerationRequest  # noqa: E402
from mlxkv.engine.sampling import SamplingParams  # noqa: E402
from mlxkv.kv import CachePool  # noqa: E402

PARAMS = SamplingParams(max_tokens=12, temp=0.0)


def picture(seed: int) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray((np.random.default_rng(seed).random((18, 22, 3)) * 255).astype("uint8")).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from mlxkv.models import load
    from mlxkv.vision.inputs import VisionInputs

    path = write_gemma3_vlm(tmp_path_factory.mktemp("vlm") / "gemma3", seed=1)
    loaded = load(str(path))
    return path, loaded, VisionInputs.for_model(path, loaded.config, loaded.tokenizer)


def image_prompt(vlm, seeds, question="What is shown here?"):
    """Token ids and image spans of a chat turn holding the images ``seeds`` then ``question``."""
    from mlxkv.vision.images import decode_image
    from mlxkv.vision.inputs import RequestImages

    _, loaded, vision = vlm
    ids = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": vision.marker * len(seeds) + question}], add_generation_prompt=True)
    images = RequestImages([decode_image(picture(s)) for s in seeds], (None,) * len(seeds))
    return vision.expand(ids, images)


def test_greedy_tokens_equal_mlx_vlm_forward_with_chunks_splitting_the_image(vlm):
    from mlx_vlm.utils import load_model

    path, loaded, vision = vlm
    prompt, media = image_prompt(vlm, [0])
    assert prompt[media[0].start - 1] == BOI_ID and media[0].end - media[0].start == 16
    pool = CachePool(loaded.model, max_sequences=1, backend="paged", num_blocks=64,
                     kv_config=KvCacheConfig(backend="paged", block_size=4))
    got = list(DirectEngine(loaded.model, None, pool=pool, prefill_step_size=5).generate_tokens(
        prompt, PARAMS, media=media))

    reference = load_model(path)  # mlx-vlm's whole model: its embeddings merge and its language model
    from mlxkv.vision.images import decode_image

    pixels = mx.array(vision.encoder.pixels(decode_image(picture(0)).image).values)  # (1, 3, 16, 16)
    ids = mx.array(prompt)[None]
    embeds = reference.get_input_embeddings(ids, pixels, mask=mx.ones(ids.shape)).inputs_embeds
    cache = reference.language_model.make_cache()
    logits = reference.language_model(ids, inputs_embeds=embeds, cache=cache).logits
    want = []
    for _ in range(PARAMS.max_tokens):
        want.append(int(mx.argmax(logits[0, -1])))
        logits = reference.language_model(mx.array([[want[-1]]]), cache=cache).logits
    assert got == want and len(set(want)) > 3


def test_preempted_image_requests_resume_exactly(vlm):
    _, loaded, _ = vlm
    prompts = [image_prompt(vlm, [s], q) for s, q in ((2, "Describe it."), (3, "What colour?"), (2, "And now?"))]
    alone = [list(DirectEngine(loaded.model, None, pool=CachePool(loaded.model, max_sequences=1)).generate_tokens(
        p, PARAMS, media=m)) for p, m in prompts]
    pool = CachePool(loaded.model, max_sequences=3, backend="paged", num_blocks=24,
                     kv_config=KvCacheConfig(backend="paged", block_size=4, kv_cache_budget=1 << 22))
    engine = BatchEngine(loaded.model, None, config=EngineConfig(max_sequences=3, prefill_chunk_size=8), pool=pool,
                         context_length=4096).start()
    try:
        handles = [engine.submit(GenerationRequest(p, PARAMS, media=m)) for p, m in prompts]
        got = [[e.token for e in h if e.kind == "token"] for h in handles]
        stats = engine.stats()
    finally:
        engine.stop()
    assert got == alone
    assert stats["preemptions"] > 0
    pool.check_invariants()


def test_two_images_key_their_own_blocks(vlm):
    """Swapping two images changes the answer and shares no block past the first image's marker."""
    _, loaded, _ = vlm
    ab, media_ab = image_prompt(vlm, [4, 5])
    ba, media_ba = image_prompt(vlm, [5, 4])
    assert ab == ba  # the same placeholder tokens: only the images' keys tell them apart
    pool = CachePool(loaded.model, max_sequences=1, backend="paged", num_blocks=64,
                     kv_config=KvCacheConfig(backend="paged", block_size=4))
    engine = DirectEngine(loaded.model, None, pool=pool)
    first = list(engine.generate_tokens(ab, PARAMS, media=media_ab))
    assert engine.last_stats.cached_prompt_tokens == 0
    swapped = list(engine.generate_tokens(ba, PARAMS, media=media_ba))
    assert engine.last_stats.cached_prompt_tokens <= media_ab[0].start  # nothing past the first image's start
    again = list(engine.generate_tokens(ab, PARAMS, media=media_ab))
    assert engine.last_stats.cached_prompt_tokens >= media_ab[1].end and again == first and swapped != first
