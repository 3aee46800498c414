"""Constrained decoding inside the batch engine: grammar rows and free rows in one decode step, preemption,
cancellation, token limits, parallel samples — on the embedded demo model (2,048-token tokenizer).

Every constrained output that ends by itself must parse and validate with ``jsonschema``; the free rows of a mixed
batch must give exactly the tokens they give alone.
"""

from __future__ import annotations

import gc
import json
import random
import weakref

import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from testkit.json_schemas import random_schema

import mlxkv.engine.constraints as engine_constraints
from mlxkv.config import KvCacheConfig
from mlxkv.engine.batch import BatchEngine, EngineConfig
from mlxkv.engine.request import GenerationRequest
from mlxkv.engine.row_sampler import RowSampler, sample_rows
from mlxkv.engine.sampling import SamplingParams
from mlxkv.kv import CachePool
from mlxkv.structured import json_object_format, json_schema_format
from mlxkv.structured.constraint import is_complete_document, make_constraint

SMALL = {"type": "object", "properties": {"word": {"enum": ["red", "green", "blue"]},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                   "maxItems": 2}},
         "required": ["word", "n", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def demo():
    from mlxkv.models import load

    return load()


def engine_for(demo, *, max_sequences=6, num_blocks=None):
    kv = KvCacheConfig(backend="paged", block_size=4, kv_cache_budget=1 << 22)
    pool = CachePool(demo.model, max_sequences=max_sequences, backend="paged", num_blocks=num_blocks, kv_config=kv)
    config = EngineConfig(max_sequences=max_sequences, prefill_chunk_size=64)
    return BatchEngine(demo.model, demo.tokenizer, config=config, pool=pool, context_length=4096).start()


def prompt_of(demo, text="Answer in JSON:"):
    return list(demo.tokenizer.encode(text))


def run(engine, requests):
    """Each request's choices as (tokens, text, finish_reason), in index order."""
    handles = [engine.submit(r) for r in requests]
    out = []
    for handle, request in zip(handles, requests):
        events = list(handle)
        assert events[-1].kind == "done", events[-1]
        choices = []
        for i in range(request.n):
            mine = [e for e in events if e.kind == "token" and e.index == i]
            choices.append(([e.token for e in mine], "".join(e.text for e in mine), mine[-1].finish_reason))
        out.append(choices)
    return out


def validated(choice, schema):
    tokens, text, finish = choice
    assert finish == "stop", (finish, text)
    jsonschema.validate(json.loads(text), schema)
    return text


def test_constrained_and_free_rows_share_steps_and_the_free_rows_are_unchanged(demo):
    """Free greedy rows (on the batch's shared argmax), a free sampled row and constrained rows at temperature
    1.0 decode together: the free rows give exactly their tokens alone, every constrained output validates."""
    rng = random.Random(3)
    schemas = [random_schema(rng) for _ in range(3)]
    free = [GenerationRequest(prompt_of(demo, q), SamplingParams(max_tokens=40))
            for q in ("What is a tuple?", "The import statement")]
    sampled = GenerationRequest(prompt_of(demo, "Generators"), SamplingParams(max_tokens=30, temp=1.0, seed=5))
    engine = engine_for(demo)
    try:
        alone = [run(engine, [r])[0][0][0] for r in free + [sampled]]
        constrained = [GenerationRequest(prompt_of(demo), SamplingParams(max_tokens=400, temp=1.0, seed=i),
                                         response_format=json_schema_format(s)) for i, s in enumerate(schemas)]
        got = run(engine, constrained + free + [sampled])
    finally:
        engine.stop()
    stats = engine.stats()  # published as the engine stopped
    for choices, schema in zip(got, schemas):
        validated(choices[0], schema)
    assert [c[0][0] for c in got[3:]] == alone
    assert stats["max_batch"] == 6 and stats["pool_sequences"] == 0


def test_preempted_constrained_sequences_resume_their_grammar_where_they_left_it(demo):
    """A block pool far too small for the batch preempts sequences mid-document: each resumes with its grammar
    where it stopped (a token consumed twice or skipped would be refused by the matcher, failing the request),
    so outputs equal a roomy pool's token for token and validate."""
    def requests():
        out = [GenerationRequest(prompt_of(demo), SamplingParams(max_tokens=120), n=2 if i == 0 else 1,
                                 response_format=json_schema_format(SMALL)) for i in range(3)]
        out += [GenerationRequest(prompt_of(demo, f"Answer {i} in JSON:"),
                                  SamplingParams(max_tokens=120, temp=1.0, seed=i),
                                  response_format=json_schema_format(SMALL)) for i in range(2)]
        return out + [GenerationRequest(prompt_of(demo, "What is a class?"), SamplingParams(max_tokens=60))]

    roomy = engine_for(demo)
    try:
        expected = run(roomy, requests())
    finally:
        roomy.stop()
    tiny = engine_for(demo, num_blocks=40)  # 39 blocks of 4 tokens: one sequence fits, six do not
    try:
        got = run(tiny, requests())
    finally:
        tiny.stop()
    stats = tiny.stats()
    assert stats["preemptions"] > 0 and stats["pool_sequences"] == 0
    greedy = [c for r in (got[:3] + got[5:]) for c in r]
    assert greedy == [c for r in (expected[:3] + expected[5:]) for c in r]
    for choices in got[:5]:
        for choice in choices:
            validated(choice, SMALL)


def test_cancelled_and_finished_requests_free_their_grammar_state(demo, monkeypatch):
    made: list[weakref.ref] = []

    def tracked(fmt, tokenizer):
        constraint = make_constraint(fmt, tokenizer)
        made.append(weakref.ref(constraint))
        return constraint

    monkeypatch.setattr(engine_constraints, "make_constraint", tracked)
    engine = engine_for(demo)
    try:
        handle = engine.submit(GenerationRequest(prompt_of(demo), SamplingParams(max_tokens=2000, temp=1.0, seed=1),
                                                 n=2, response_format=json_object_format()))
        seen = 0
        for event in handle:
            seen += event.kind == "token"
            if seen == 6:
                handle.cancel()
        assert event.finish_reason == "cancelled"
        run(engine, [GenerationRequest(prompt_of(demo), SamplingParams(max_tokens=120),
                                       response_format=json_schema_format(SMALL))])
    finally:
        engine.stop()
    stats = engine.stats()
    gc.collect()
    assert len(made) == 3 and all(ref() is None for ref in made)
    assert stats["pool_sequences"] == 0 and stats["cancelled_total"] == 1


def test_a_document_cut_by_max_tokens_ends_with_length(demo):
    engine = engine_for(demo)
    try:
        (choice,), = run(engine, [GenerationRequest(prompt_of(demo), SamplingParams(max_tokens=4),
                                                    response_format=json_schema_format(SMALL))])
    finally:
        engine.stop()
    tokens, text, finish = choice
    assert finish == "length" and len(tokens) == 4
    assert text.startswith('{"word') and not is_complete_document(json_schema_format(SMALL), demo.tokenizer, text)


def test_parallel_samples_follow_one_grammar_each(demo):
    engine = engine_for(demo)
    try:
        (choices,) = run(engine, [GenerationRequest(prompt_of(demo), SamplingParams(max_tokens=120, temp=1.0, seed=7),
                                                    n=4, response_format=json_schema_format(SMALL))])
    finally:
        engine.stop()
    texts = [validated(c, SMALL) for c in choices]
    assert len(set(texts)) > 1  # each sample is its own document


def test_masked_rows_draw_only_allowed_tokens_and_plain_rows_keep_the_shared_argmax(demo, monkeypatch):
    samplers = [RowSampler(SamplingParams()), RowSampler(SamplingParams(temp=1.0), seed=1),
                RowSampler(SamplingParams()), RowSampler(SamplingParams())]
    constraint = make_constraint(json_schema_format(SMALL), demo.tokenizer)
    width = 2100  # wider than the vocabulary, as padded embeddings are
    logits = mx.random.normal((4, width), key=mx.random.key(0))
    words = constraint.words(width)
    called = []
    original = RowSampler.__call__
    monkeypatch.setattr(RowSampler, "__call__", lambda self, *a, **k: called.append(self) or original(self, *a, **k))
    tokens = sample_rows(logits, samplers, [None, words, words, None]).tolist()
    allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:width])
    assert tokens[1] in allowed and tokens[2] in allowed
    assert tokens[2] == allowed[np.argmax(np.array(logits[2])[allowed])]
    assert [tokens[0], tokens[3]] == mx.argmax(logits, axis=-1).tolist()[0::3]
    assert called == samplers[1:3]  # the plain rows never sampled on their own
