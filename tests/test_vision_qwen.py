"""Qwen2-VL and Qwen2.5-VL images in the engine (3-D M-RoPE positions) on tiny random-weight models: greedy tokens
equal mlx-vlm's own generate; with prefix-cache reuse (the same image twice, a shared image with another question,
a second turn) equal without; batched rows whose images shift their positions differently, a text-only row, forks
and preempted rows each equal their answer alone."""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm", reason='needs the vision extra: pip install "mlxkv[vision]"')

from testkit.vlm import IMAGE_PAD_ID, VISION_END_ID, VISION_START_ID, write_qwen_vl  # noqa: E402

from mlxkv.config import EngineConfig, KvCacheConfig  # noqa: E402
from mlxkv.engine.batch import BatchEngine  # noqa: E402
from mlxkv.engine.direct import DirectEngine  # noqa: E402
from mlxkv.engine.request import GenerationRequest  # noqa: E402
from mlxkv.engine.sampling import SamplingParams  # noqa: E402
from mlxkv.kv import CachePool  # noqa: E402

PARAMS = SamplingParams(max_tokens=10, temp=0.0)


def picture(seed: int, size: tuple[int, int] = (18, 22)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8")).save(out, "PNG")
    return out.getvalue()


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm(request, tmp_path_factory):
    from mlxkv.models import load
    from mlxkv.vision.inputs import VisionInputs

    path = write_qwen_vl(tmp_path_factory.mktemp("vlm") / request.param, seed=1, model_type=request.param)
    loaded = load(str(path))
    return path, loaded, VisionInputs.for_model(path, loaded.config, loaded.tokenizer, model=loaded.model)


def image_prompt(vlm, images, question="What is shown here?", history=()):
    """Token ids and image spans of a chat turn: ``images`` (``(seed, size)``) each followed by a line of text, then
    ``question``; ``history``: earlier messages (text)."""
    from mlxkv.vision.images import decode_image
    from mlxkv.vision.inputs import RequestImages

    _, loaded, vision = vlm
    content = "".join(f"{vision.marker}Picture {i}.\n" for i in range(len(images))) + question
    ids = loaded.tokenizer.apply_chat_template([*history, {"role": "user", "content": content}],
                                               add_generation_prompt=True)
    decoded = [decode_image(picture(seed, size)) for seed, size in images]
    return vision.expand(ids, RequestImages(decoded, (None,) * len(decoded)))


def paged_engine(loaded, step=5, blocks=96):
    pool = CachePool(loaded.model, max_sequences=1, backend="paged", num_blocks=blocks,
                     kv_config=KvCacheConfig(backend="paged", block_size=4))
    return DirectEngine(loaded.model, None, pool=pool, prefill_step_size=step)


def test_greedy_tokens_equal_mlx_vlm_generate_with_two_images_and_chunks_splitting_them(vlm):
    from mlx_vlm.generate import generate_step
    from mlx_vlm.utils import load_model

    from mlxkv.vision.images import decode_image

    path, loaded, vision = vlm
    images = [(0, (18, 22)), (1, (40, 20))]
    prompt, media = image_prompt(vlm, images)
    assert [m.grid for m in media] == [(1, 2, 3), (1, 5, 2)]  # aspect ratios kept: 6 and 10 tokens
    assert prompt[media[0].start - 1] == VISION_START_ID and prompt[media[0].end] == VISION_END_ID
    assert all(prompt[m.start : m.end] == [IMAGE_PAD_ID] * (m.end - m.start) for m in media)
    got = list(paged_engine(loaded).generate_tokens(prompt, PARAMS, media=media))

    reference = load_model(path)  # mlx-vlm's whole model: its vision tower, get_rope_index and language model
    pixels = [vision.encoder.pixels(decode_image(picture(s, size)).image) for s, size in images]
    steps = generate_step(mx.array(prompt)[None], reference, mx.array(np.concatenate([p.values for p in pixels])),
                          None, max_tokens=PARAMS.max_tokens, temperature=0.0,
                          image_grid_thw=mx.array([p.grid for p in pixels]))
    want = [int(token) for token, _ in steps]
    assert got == want and len(set(want)) > 3


def test_the_image_shifts_later_positions(vlm):
    """An image's tokens sit on its grid; the text after it continues from the grid's extent, whichever chunk asks."""
    from mlxkv.vision.mrope import rope_positions

    prompt, media = image_prompt(vlm, [(1, (40, 20))])
    positions = rope_positions(media, 0, len(prompt))  # (3, len)
    span = media[0]
    assert positions[:, span.start - 1].tolist() == [span.start - 1] * 3
    assert positions[:, span.start : span.end].max() == span.start + 4  # a 1 x 5 x 2 grid spans 5 positions
    assert positions[:, span.end].tolist() == [span.start + 5] * 3  # the text after it: shifted back by 10 - 5
    assert (rope_positions(media, 7, 9) == positions[:, 7:16]).all()  # any chunk: the same positions


def test_reuse_equals_no_reuse_for_the_same_image_another_question_and_a_second_turn(vlm):
    _, loaded, vision = vlm
    engine = paged_engine(loaded)
    image = [(2, (30, 26))]
    prompt, media = image_prompt(vlm, image, "Describe it.")
    first = list(engine.generate_tokens(prompt, PARAMS, media=media))
    assert engine.last_stats.cached_prompt_tokens == 0
    lookups = vision.stats()["encoder_cache_hits"] + vision.stats()["encoder_cache_misses"]
    same, same_media = image_prompt(vlm, image, "Describe it.")  # a new request: its spans hold no features yet
    again = list(engine.generate_tokens(same, PARAMS, media=same_media))
    assert again == first and engine.last_stats.cached_prompt_tokens >= media[0].end
    # the prefix hit covered the image: its features were never asked for (the shift came from its span)
    assert vision.stats()["encoder_cache_hits"] + vision.stats()["encoder_cache_misses"] == lookups

    other, other_media = image_prompt(vlm, image, "What colour is it?")
    answer = list(engine.generate_tokens(other, PARAMS, media=other_media))
    assert engine.last_stats.cached_prompt_tokens >= other_media[0].end
    assert answer == list(paged_engine(loaded).generate_tokens(other, PARAMS, media=other_media))

    text = loaded.tokenizer.decode(first)
    history = [{"role": "user", "content": "Describe it."}, {"role": "assistant", "content": text}]
    follow, follow_media = _second_turn(vlm, image, history)
    second = list(engine.generate_tokens(follow, PARAMS, media=follow_media))
    assert engine.last_stats.cached_prompt_tokens >= follow_media[0].end
    assert second == list(paged_engine(loaded).generate_tokens(follow, PARAMS, media=follow_media))


def _second_turn(vlm, images, history):
    """A conversation whose first user message holds the images, then an answer, then a text question."""
    from mlxkv.vision.images import decode_image
    from mlxkv.vision.inputs import RequestImages

    _, loaded, vision = vlm
    messages = [{"role": "user", "content": vision.marker * len(images) + history[0]["content"]}, history[1],
                {"role": "user", "content": "And its colour?"}]
    ids = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    decoded = [decode_image(picture(seed, size)) for seed, size in images]
    return vision.expand(ids, RequestImages(decoded, (None,) * len(decoded)))


def test_batched_rows_with_different_shifts_forks_and_preemption_equal_each_alone(vlm):
    _, loaded, _ = vlm
    prompts = [image_prompt(vlm, [(3, (18, 22))], "Describe it."),  # 6 image tokens, 3 positions saved
               image_prompt(vlm, [(4, (48, 48))], "What colour?"),  # 36 tokens, 30 saved
               (loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there."}],
                                                     add_generation_prompt=True), ())]
    alone = [list(paged_engine(loaded).generate_tokens(p, PARAMS, media=m)) for p, m in prompts]
    for blocks, preempts in ((256, False), (20, True)):
        pool = CachePool(loaded.model, max_sequences=4, backend="paged", num_blocks=blocks,
                         kv_config=KvCacheConfig(backend="paged", block_size=4))
        engine = BatchEngine(loaded.model, None, config=EngineConfig(max_sequences=4, prefill_chunk_size=8),
                             pool=pool, context_length=4096).start()
        try:
            handles = [engine.submit(GenerationRequest(p, PARAMS, media=m, n=2 if i == 1 and not preempts else 1))
                       for i, (p, m) in enumerate(prompts)]
            got = [[e for e in h if e.kind == "token"] for h in handles]
            stats = engine.stats()
        finally:
            engine.stop()
        for events, want in zip(got, alone):
            for index in {e.index for e in events}:
                assert [e.token for e in events if e.index == index] == want
        assert stats["batched_steps_total"] > 0  # rows with different shifts decoded together
        assert (stats["preemptions"] > 0) == preempts
        pool.check_invariants()
