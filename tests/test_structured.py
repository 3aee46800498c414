"""Structured output by constrained decoding: response_format checking, the token constraint, the direct engine
and ``mlxkv generate --json / --json-schema``.

Fast tests run on the embedded demo model (2,048-token tokenizer); the real-model test samples SmolLM2-135M at
temperature 1.0 over random schemas (behind ``MLXKV_TEST_GGUF``). Every output must parse and validate with
``jsonschema``.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys

import jsonschema
import mlx.core as mx
import pytest
from testkit.real_model import GGUF
from testkit.json_schemas import instance, random_schema

from mlxkv.engine.direct import DirectEngine
from mlxkv.engine.sampling import SamplingParams
from mlxkv.structured import json_object_format, json_schema_format, parse_response_format, schema_file_format
from mlxkv.structured.constraint import ConstraintError, is_complete_document, make_constraint
from mlxkv.structured.response_format import grammar_for
from mlxkv.structured.vocabulary import vocabulary_for

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def demo():
    from mlxkv.models import load

    return load()


def _encode(tokenizer, value) -> list[int]:
    return tokenizer.encode(json.dumps(value), add_special_tokens=False)


# ---- response_format -----------------------------------------------------------------------------------------


def test_text_and_none_are_unconstrained():
    assert not parse_response_format(None).constrained
    assert not parse_response_format({"type": "text"}).constrained


def test_json_schema_keeps_the_schema_and_its_property_order():
    fmt = parse_response_format({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                        "strict": True}})
    assert fmt.kind == "json_schema" and fmt.name == "person" and fmt.schema == PERSON
    assert list(fmt.schema["properties"]) == ["name", "age"]  # generation follows this order
    assert parse_response_format({"type": "json_object"}).schema == {"type": "object"}


@pytest.mark.parametrize("value, fragment", [
    ("json", "must be an object"),
    ({"type": "xml"}, "one of text, json_object, json_schema"),
    ({"type": "json_object", "schema": {}}, "unsupported field(s) schema"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "name must be"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": PERSON}}, "name must be"),
    ({"type": "json_schema", "json_schema": {"name": "p"}}, "schema is required"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": [1]}}, "must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": "yes"}}, "strict must be"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "extra": 1}}, "unsupported field(s) extra"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "array", "uniqueItems": True}}},
     "not supported for constrained decoding: uniqueItems"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"if": {}, "then": {}}}}, "if, then"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"$ref": "#/$defs/missing"}}}, "does not exist"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strng"}}}, "Invalid type: strng"),
])
def test_bad_response_formats_are_value_errors_that_say_why(value, fragment):
    with pytest.raises(ValueError, match=None) as info:
        parse_response_format(value)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


def test_grammars_are_compiled_once_per_schema_text():
    grammar_for.cache_clear()
    json_schema_format(PERSON)
    json_schema_format(dict(PERSON))
    assert grammar_for.cache_info().hits == 1 and grammar_for.cache_info().misses == 1


def test_schema_file_errors_are_readable(tmp_path):
    with pytest.raises(ValueError, match="cannot read the JSON schema file"):
        schema_file_format(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"type": ')
    with pytest.raises(ValueError, match="is not JSON"):
        schema_file_format(tmp_path / "bad.json")
    (tmp_path / "my schema.json").write_text(json.dumps(PERSON))
    assert schema_file_format(tmp_path / "my schema.json").name == "my_schema"


# ---- the constraint ------------------------------------------------------------------------------------------


def test_a_valid_document_passes_token_by_token_and_eos_comes_only_at_its_end(demo):
    tokenizer = demo.tokenizer
    constraint = make_constraint(json_schema_format(PERSON), tokenizer)
    eos = tokenizer.eos_token_id
    tokens = _encode(tokenizer, {"name": "Ann", "age": 42})
    for token in tokens:
        mask = constraint.mask()
        assert mask.shape == (constraint.vocabulary.vocab_size,) and mask.dtype == mx.bool_
        assert bool(mask[token]) and not bool(mask[eos])
        assert not constraint.is_complete()
        constraint.advance(token)
    assert constraint.is_complete() and constraint.is_finished()
    assert constraint.mask().tolist() == [i == eos for i in range(constraint.vocabulary.vocab_size)]
    constraint.advance(eos)
    assert constraint.is_finished()


def test_a_token_outside_the_mask_is_refused(demo):
    constraint = make_constraint(json_schema_format(PERSON), demo.tokenizer)
    letter = demo.tokenizer.encode("x", add_special_tokens=False)[0]
    assert not bool(constraint.mask()[letter])
    with pytest.raises(ConstraintError, match="not allowed by the grammar"):
        constraint.advance(letter)


def test_number_ranges_are_in_the_mask(demo):
    constraint = make_constraint(json_schema_format({"type": "integer", "minimum": 3, "maximum": 5}), demo.tokenizer)
    digits = {d: demo.tokenizer.encode(str(d), add_special_tokens=False) for d in range(10)}
    assert all(len(t) == 1 for t in digits.values())
    mask = constraint.mask()
    assert [d for d, (t,) in digits.items() if bool(mask[t])] == [3, 4, 5]


def test_logits_wider_than_the_vocabulary_are_padded_with_disallowed(demo):
    constraint = make_constraint(json_object_format(), demo.tokenizer)
    vocab = constraint.vocabulary.vocab_size
    logits = mx.zeros((1, vocab + 64))  # (1, width)
    out = constraint.apply(logits)
    assert out.shape == (1, vocab + 64)
    assert mx.all(out[0, vocab:] == -mx.inf).item()
    allowed = constraint.mask(vocab + 64)
    assert mx.array_equal(out[0] == 0, allowed)  # kept logits unchanged, the rest -inf
    assert int(allowed.sum()) >= 1


def test_a_batch_masks_constrained_rows_and_leaves_free_rows_alone(demo):
    from mlxkv.structured.constraint import apply_constraints

    tokenizer = demo.tokenizer
    person, number = (make_constraint(json_schema_format(s), tokenizer)
                      for s in (PERSON, {"type": "integer", "minimum": 3, "maximum": 5}))
    vocab = person.vocabulary.vocab_size
    logits = mx.random.normal((3, vocab + 10))  # (B, width): a padded embedding
    out = apply_constraints(logits, [person, None, number])
    assert mx.array_equal(out[1], logits[1])
    for row, constraint in ((0, person), (2, number)):
        allowed = constraint.mask(vocab + 10)
        assert mx.array_equal(out[row], mx.where(allowed, logits[row], -mx.inf))
    assert mx.array_equal(person.apply(logits[0]), out[0])  # one row, any leading shape


def test_as_a_logits_processor_it_advances_by_the_last_token_after_the_first_call(demo):
    tokenizer = demo.tokenizer
    constraint = make_constraint(json_schema_format(PERSON), tokenizer)
    prompt = tokenizer.encode("a person:")
    doc = _encode(tokenizer, {"name": "Bo", "age": 7})
    logits = mx.zeros((1, constraint.vocabulary.vocab_size))
    out = constraint(mx.array(prompt), logits)  # the prompt's last token is not a JSON token
    assert out[0, doc[0]].item() == 0
    for i in range(1, len(doc)):
        out = constraint(mx.array(prompt + doc[:i]), logits)
        assert out[0, doc[i]].item() == 0
    out = constraint(mx.array(prompt + doc), logits)
    assert out[0, tokenizer.eos_token_id].item() == 0 and constraint.is_complete()


def test_matchers_and_vocabularies_are_built_once(demo):
    vocabulary = vocabulary_for(demo.tokenizer)
    assert vocabulary_for(demo.tokenizer) is vocabulary
    fmt = json_schema_format({"type": "object", "properties": {"q": {"type": "boolean"}}, "required": ["q"]})
    make_constraint(fmt, demo.tokenizer)
    cached = len(vocabulary._matchers)
    first, second = make_constraint(fmt, demo.tokenizer), make_constraint(fmt, demo.tokenizer)
    assert len(vocabulary._matchers) == cached
    first.advance(_encode(demo.tokenizer, {"q": True})[0])  # copies: one sequence's progress is its own
    assert not mx.array_equal(first.mask(), second.mask())


def test_complete_documents_are_told_from_cut_ones(demo):
    fmt = json_schema_format(PERSON)
    assert is_complete_document(fmt, demo.tokenizer, '{"name": "A", "age": 1}')
    assert not is_complete_document(fmt, demo.tokenizer, '{"name": "A", "age": ')
    assert not is_complete_document(fmt, demo.tokenizer, '{"name": "A", "age": 1000}')
    assert is_complete_document(parse_response_format(None), demo.tokenizer, "anything")


# ---- the direct engine ----------------------------------------------------------------------------------------


def _generate(engine, tokenizer, fmt, *, temp: float, seed: int, max_tokens: int = 400) -> str:
    constraint = make_constraint(fmt, tokenizer)
    prompt = tokenizer.encode("Answer in JSON:")
    params = SamplingParams(max_tokens=max_tokens, temp=temp, seed=seed)
    return "".join(c.text for c in engine.generate(prompt, params, logits_processors=(constraint,)))


@pytest.mark.parametrize("backend", ["dense", "paged"])
def test_sampled_outputs_validate_over_random_schemas(demo, backend):
    from mlxkv.kv import CachePool

    # 64 blocks of 16 tokens hold a prompt and 400 tokens; the default "auto" budget would size the paged pool to
    # 90% of the machine's free memory and fill it at the first write.
    pool = CachePool(demo.model, max_sequences=1, backend=backend, num_blocks=64 if backend == "paged" else None)
    engine = DirectEngine(demo.model, demo.tokenizer, pool=pool)
    rng = random.Random(7 if backend == "dense" else 8)
    for i in range(12):
        schema = random_schema(rng)
        text = _generate(engine, demo.tokenizer, json_schema_format(schema), temp=1.0, seed=i)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_gives_an_object_at_any_temperature(demo):
    """json_object bounds nothing (a string may go on to max_tokens): every output that ends with EOS is an
    object, and the ones cut at max_tokens are still prefixes of one."""
    engine, tokenizer, fmt = DirectEngine(demo.model, demo.tokenizer), demo.tokenizer, json_object_format()
    ended = 0
    for temp, seed in ((0.0, 0), (1.0, 1), (1.0, 2), (1.5, 3), (1.5, 4)):
        constraint = make_constraint(fmt, tokenizer)
        params = SamplingParams(max_tokens=200, temp=temp, seed=seed)
        chunks = list(engine.generate(tokenizer.encode("Answer in JSON:"), params, logits_processors=(constraint,)))
        text = "".join(c.text for c in chunks)
        if chunks[-1].finish_reason == "stop":
            ended += 1
            assert isinstance(json.loads(text), dict)
        else:
            assert not is_complete_document(fmt, tokenizer, text) and text.startswith("{")
    assert ended >= 2


def test_the_random_schema_builder_makes_valid_instances():
    rng = random.Random(0)
    for _ in range(50):
        schema = random_schema(rng)
        jsonschema.Draft202012Validator.check_schema(schema)
        jsonschema.validate(instance(schema, rng), schema)


def test_speculative_decoding_refuses_logits_processors(demo):
    from mlxkv.engine.drafters import PromptLookupDrafter
    from mlxkv.engine.speculative import SpeculativeEngine

    engine = SpeculativeEngine(demo.model, demo.tokenizer, PromptLookupDrafter(ngram_size=2))
    constraint = make_constraint(json_object_format(), demo.tokenizer)
    with pytest.raises(ValueError, match="speculative decoding does not apply logits processors"):
        next(engine.generate_tokens([1, 2, 3], SamplingParams(max_tokens=4), logits_processors=(constraint,)))


# ---- mlxkv generate --json / --json-schema ----------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxkv", "generate", *args], capture_output=True, text=True,
                          timeout=120)


def test_cli_json_schema_prints_a_valid_document(tmp_path):
    schema = {"type": "object", "properties": {"word": {"enum": ["yes", "no"]},
                                               "n": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["word", "n"], "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    result = _cli("Reply:", "--json-schema", str(tmp_path / "s.json"), "--temp", "1.0", "--seed", "3", "-n", "64")
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), schema)


def test_cli_json_cut_by_max_tokens_fails_in_one_line():
    result = _cli("Reply:", "--json-schema", "/dev/null", "-n", "2")
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "is not JSON" in result.stderr
    result = _cli("Reply:", "--json", "-n", "1", "--temp", "1.0", "--seed", "1")
    assert result.returncode in (0, 1)
    if result.returncode == 1:
        assert result.stderr.strip().startswith("error: the JSON output is incomplete")


@pytest.mark.parametrize("args, fragment", [
    (["--json-schema", "/no/such/schema.json"], "cannot read the JSON schema file"),
])
def test_cli_refusals_are_one_line_and_non_zero(args, fragment):
    result = _cli("Reply:", *args)
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and fragment in result.stderr


def test_cli_json_with_prompt_lookup_prints_the_plain_document(tmp_path):
    """Proposed tokens are cut where the grammar refuses them and each verified position is masked: the document is
    the one plain constrained decoding prints."""
    (tmp_path / "s.json").write_text(json.dumps(PERSON))
    args = ("Name a person called Ada Ada Ada, aged 36.", "--json-schema", str(tmp_path / "s.json"), "-n", "48")
    plain, spec = _cli(*args), _cli(*args, "--prompt-lookup", "--verbose")
    assert plain.returncode == spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and "speculative: acceptance" in spec.stderr


def test_cli_unsupported_schema_feature_is_named(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}))
    result = _cli("Reply:", "--json-schema", str(tmp_path / "s.json"))
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "uniqueItems" in result.stderr


def test_cli_json_and_json_schema_exclude_each_other(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps(PERSON))
    result = _cli("Reply:", "--json", "--json-schema", str(tmp_path / "s.json"))
    assert result.returncode == 2 and "exclude each other" in result.stderr


# ---- the real model ------------------------------------------------------------------------------------------

REAL_SCHEMAS = 6


@pytest.mark.real_model
def test_real_model_outputs_validate_at_temperature_one():
    from mlxkv.models import load

    loaded = load(str(GGUF), dequantize=True)
    tokenizer = loaded.tokenizer
    engine = DirectEngine(loaded.model, tokenizer)
    rng = random.Random(19)
    for i in range(REAL_SCHEMAS):
        schema = random_schema(rng)
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Reply with a JSON object with the fields {', '.join(schema['properties'])}."}],
            add_generation_prompt=True)
        constraint = make_constraint(json_schema_format(schema), tokenizer)
        params = SamplingParams(max_tokens=300, temp=1.0, seed=i)
        text = "".join(c.text for c in engine.generate(prompt, params, logits_processors=(constraint,)))
        jsonschema.validate(json.loads(text), schema)
