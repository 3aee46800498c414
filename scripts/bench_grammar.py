"""Grammar engines for structured output on SmolLM2-135M-Instruct's real tokenizer (49,152 tokens).

Candidates: llguidance, xgrammar, outlines-core (each skipped, with the reason, when it does not import;
xgrammar imports PyTorch, so run this script with a Python that has it to include xgrammar). Measured:

1. tokenizer setup: building the engine's view of the vocabulary (once per tokenizer);
2. compile: a fresh compile of each schema (small object, nested with arrays and enums, 30 properties, and
   ``json_object``), and the first mask after it (llguidance builds its lexer lazily);
3. mask cost at batch 8: eight matchers advance in lockstep through eight valid documents (canonical
   tokenization); per row-step, the mask computed row by row, and through the engine's batch API;
4. correctness on tricky schemas: valid documents must pass token by token with EOS allowed at the end, invalid
   ones must be stopped; random walks (uniform over the allowed tokens) must end in documents that validate;
5. mlxkv's path (``mlxkv.structured``, llguidance): "mask + apply" per row-step at batch 8 — the bitmask, its
   unpacking, ``mx.where`` on the (1, vocab) logits row, evaluated — against the model's decode step at batch
   1 and 8 (mlx-lm KV caches, float32 weights), the ratio the goal "constrained decoding costs <= 10% of
   decode tok/s at batch 8" is judged by (masks computed row by row, not overlapped with the forward).

Figures are medians over ``--repeats``. The CPU is shared: run once, briefly.

    python scripts/bench_grammar.py                      # the reference GGUF's tokenizer
    /path/to/python-with-torch scripts/bench_grammar.py  # xgrammar included
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import statistics
import time
from typing import Any

import numpy as np
from bench_common import default_model, ensure_openblas, versions
from testkit.json_schemas import instance

SEP = (", ", ": ")
SMALL = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
         "required": ["name", "age"], "additionalProperties": False}
NESTED = {"type": "object", "additionalProperties": False, "required": ["id", "status", "owner", "items"],
          "properties": {
              "id": {"type": "integer", "minimum": 1, "maximum": 99999},
              "status": {"enum": ["open", "closed", "pending"]},
              "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
              "owner": {"type": "object", "additionalProperties": False, "required": ["name"],
                        "properties": {"name": {"type": "string", "maxLength": 16}, "admin": {"type": "boolean"}}},
              "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                  "type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
                  "properties": {"sku": {"type": "string", "maxLength": 8},
                                 "qty": {"type": "integer", "minimum": 1, "maximum": 50},
                                 "price": {"type": "number", "minimum": 0, "maximum": 1000}}}}}}
_KINDS = [{"type": "string", "maxLength": 12}, {"type": "integer", "minimum": 0, "maximum": 500},
          {"type": "boolean"}, {"type": "number", "minimum": -10, "maximum": 10}, {"enum": ["a", "b", "c"]}]
WIDE = {"type": "object", "additionalProperties": False, "required": [f"field_{i}" for i in range(30)],
        "properties": {f"field_{i}": _KINDS[i % 5] for i in range(30)}}
ANY_OBJECT = None  # json_object: any JSON object
SCHEMAS = {"small": SMALL, "nested": NESTED, "wide-30": WIDE, "json_object": ANY_OBJECT}

# (name, schema, valid documents, invalid documents)
TRICKY = [
    ("unicode maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, ["é日x", "ab"], ["abcd", "a"]),
    ("escapes", {"type": "string", "maxLength": 8}, ['a"b\\\n', "é\t"], []),
    ("negative int range", {"type": "integer", "minimum": -15, "maximum": 7}, [-15, 0, 7], [-16, 8, 70]),
    ("exclusive number", {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5}, [0.001, 1.5, 1], [0, 1.6, -0.1]),
    ("mixed enum", {"enum": ["red", 1, None, True]}, ["red", 1, None, True], ["blue", 2, False]),
    ("const", {"const": "x"}, ["x"], ["y"]),
    ("optional properties", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                                              "c": {"type": "boolean"}},
                             "required": ["b"], "additionalProperties": False},
     [{"b": "x"}, {"a": 1, "b": "x"}, {"b": "", "c": False}], [{"a": 1}, {"b": "x", "d": 1}]),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}, [5, "ab"], ["abc", 1.5]),
    ("recursive $ref", {"$defs": {"node": {"type": "object", "additionalProperties": False,
                                           "required": ["v", "kids"],
                                           "properties": {"v": {"type": "integer"}, "kids": {
                                               "type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}}}}},
                        "$ref": "#/$defs/node"},
     [{"v": 1, "kids": [{"v": 2, "kids": []}]}], [{"v": 1}, {"v": 1, "kids": [{"v": "x", "kids": []}]}]),
    ("array bounds", {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
     [[1, 2], [1, 2, 3]], [[1], [1, 2, 3, 4]]),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
     [["a", 1]], [[1, "a"], ["a", 1, 2]]),
    ("pattern", {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, ["AB-123"], ["ab-123", "AB-12"]),
    ("format date", {"type": "string", "format": "date"}, ["2024-02-29"], ["2024-13-01", "yesterday"]),
    ("additionalProperties schema", {"type": "object", "additionalProperties": {"type": "integer"}},
     [{"x": 1}, {}], [{"x": "s"}]),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [[1, 2]], [[1, 1]]),
    ("minProperties", {"type": "object", "minProperties": 1}, [{"a": 1}], [{}]),
]


def dumps(value: Any) -> str:
    return json.dumps(value, separators=SEP, ensure_ascii=False)


def median_of(f, repeats: int) -> float:
    return statistics.median(f() for _ in range(repeats))


# ---- engines: one adapter each ------------------------------------------------------------------------------


class Llguidance:
    name = "llguidance"

    def __init__(self, hf: Any, eos: int, vocab: int):
        import llguidance
        import llguidance.hf

        self.ll, self.version = llguidance, importlib.metadata.version("llguidance")
        self.tok = llguidance.hf.from_tokenizer(hf, eos_token=eos)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: dict | None) -> Any:
        options = {"whitespace_flexible": False, "item_separator": SEP[0], "key_separator": SEP[1]}
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema or {"type": "object"}, defaults=options)
        matcher = self.ll.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error().splitlines()[0])
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matchers: list, bits: np.ndarray) -> None:
        for i, m in enumerate(matchers):
            m.unsafe_compute_mask_ptr(bits[i].ctypes.data, bits[i].nbytes)

    def fill_batch(self, matchers: list, bits: np.ndarray) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bits.ctypes.data,
                                              bits[0].nbytes, len(bits))

    def consume(self, m: Any, token: int) -> bool:
        return m.consume_token(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, hf: Any, eos: int, vocab: int):
        import xgrammar

        self.xgr, self.version = xgrammar, importlib.metadata.version("xgrammar")
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: dict | None) -> Any:
        # strict_mode=False keeps JSON Schema's meaning (extra properties allowed unless the schema says not).
        return self.compiler.compile_json_schema(json.dumps(schema or {"type": "object"}), any_whitespace=False,
                                                 separators=SEP, strict_mode=False)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list, bits: np.ndarray) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bits, i)

    def fill_batch(self, matchers: list, bits: np.ndarray) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bits)

    def consume(self, m: Any, token: int) -> bool:
        return m.accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, hf: Any, eos: int, vocab: int):
        import outlines_core

        self.oc, self.version = outlines_core, importlib.metadata.version("outlines-core")
        self.vocabulary, self.eos = outlines_core.Vocabulary(eos, token_bytes(hf, skip={eos})), eos

    def compile(self, schema: dict | None) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema or {"type": "object"}), r"[ ]?")
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matchers: list, bits: np.ndarray) -> None:
        for i, g in enumerate(matchers):
            g.write_mask_into(bits[i].ctypes.data, bits[i].size, 4)

    fill_batch = None  # no batch API

    def consume(self, g: Any, token: int) -> bool:
        if token == self.eos:  # its Guide has no transition on EOS: EOS is allowed in final states
            return g.is_finished()
        try:
            g.advance(token, return_tokens=False)
            return True
        except ValueError:
            return False


def token_bytes(hf: Any, skip: set[int]) -> dict[bytes, list[int]]:
    """Byte-level BPE tokens as raw bytes (GPT-2's byte-to-unicode map undone); special tokens left out."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = printable + [256 + n for n in range(256 - len(printable))]
    byte_of = {chr(c): b for c, b in zip(chars, printable + [b for b in range(256) if b not in printable])}
    special = set(hf.all_special_ids) | {i for i, t in hf.added_tokens_decoder.items() if t.special}
    out: dict[bytes, list[int]] = {}
    for text, i in hf.get_vocab().items():
        if i in skip or i in special:
            continue
        out.setdefault(bytes(byte_of[c] for c in text), []).append(i)
    return out


ENGINES = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines-core": OutlinesCore}


def allowed(bits: np.ndarray, row: int, token: int) -> bool:
    return bool((int(bits[row, token // 32]) >> (token % 32)) & 1)


# ---- measurements ---------------------------------------------------------------------------------------------


def lockstep(engine: Any, compiled: Any, docs: list[list[int]], words: int, batch_api: bool) -> tuple[float, int]:
    """Mask seconds per row-step over ``docs`` advanced in lockstep, and how many canonical tokens the masks
    forbade (0 unless the engine is wrong)."""
    matchers = [engine.matcher(compiled) for _ in docs]
    bits = np.zeros((len(docs), words), dtype=np.int32)
    spent, row_steps, forbidden = 0.0, 0, 0
    for step in range(max(map(len, docs))):
        rows = [i for i, d in enumerate(docs) if step < len(d)]
        active = [matchers[i] for i in rows]
        start = time.perf_counter()
        (engine.fill_batch if batch_api else engine.fill)(active, bits[: len(rows)])
        spent += time.perf_counter() - start
        row_steps += len(rows)
        for k, i in enumerate(rows):
            forbidden += not allowed(bits, k, docs[i][step])
            engine.consume(matchers[i], docs[i][step])
    return spent / row_steps, forbidden


def check_case(engine: Any, schema: dict, valid: list, invalid: list, tokenizer: Any, eos: int, words: int,
               rng: random.Random, walks: int) -> str:
    import jsonschema

    try:
        compiled = engine.compile(schema)
        engine.matcher(compiled)
    except Exception as exc:  # noqa: BLE001 - any refusal is a result here
        return f"refused ({' '.join(str(exc).split())[:60]})"
    problems = []
    bits = np.zeros((1, words), dtype=np.int32)

    def passes(doc: Any) -> bool:
        m = engine.matcher(compiled)
        for token in tokenizer.encode(dumps(doc), add_special_tokens=False) + [eos]:
            engine.fill([m], bits)
            if not allowed(bits, 0, token) or not engine.consume(m, token):
                return False
        return True

    problems += [f"rejects valid {dumps(d)}" for d in valid if not passes(d)]
    problems += [f"accepts invalid {dumps(d)}" for d in invalid if passes(d)]
    bad_walks = 0
    for _ in range(walks):
        m, out = engine.matcher(compiled), []
        for _ in range(300):
            engine.fill([m], bits)
            ids = np.flatnonzero(np.unpackbits(bits[0].view(np.uint8), bitorder="little"))
            token = int(rng.choice(ids)) if len(ids) else eos
            if token == eos:
                break
            engine.consume(m, token)
            out.append(token)
        else:
            continue  # did not finish in 300 tokens: not judged
        try:
            jsonschema.validate(json.loads(tokenizer.decode(out)), schema)
        except Exception:  # noqa: BLE001
            bad_walks += 1
    if bad_walks:
        problems.append(f"{bad_walks}/{walks} random walks invalid")
    return "ok" if not problems else "WRONG: " + "; ".join(problems)


def mlxkv_mask_apply(tokenizer: Any, docs: list[list[int]], width: int, repeats: int) -> tuple[float, float]:
    """Seconds per row-step of mlxkv.structured's constraints over ``docs`` in lockstep — llguidance's mask,
    then the masked logits evaluated — row by row (``TokenConstraint.apply`` on each (1, width) row, as a
    per-row logits processor runs) and for the whole batch at once (``apply_constraints``, one MLX op)."""
    import mlx.core as mx

    from mlxkv.structured import json_schema_format
    from mlxkv.structured.constraint import apply_constraints, make_constraint

    fmt = json_schema_format(NESTED)
    logits = mx.random.normal((len(docs), width))  # (B, width)
    mx.eval(logits)

    def run(batched: bool) -> float:
        constraints = [make_constraint(fmt, tokenizer) for _ in docs]
        spent, row_steps = 0.0, 0
        for step in range(max(map(len, docs))):
            rows = [i for i, d in enumerate(docs) if step < len(d)]
            start = time.perf_counter()
            if batched:
                mx.eval(apply_constraints(logits[: len(rows)], [constraints[i] for i in rows]))
            else:
                mx.eval([constraints[i].apply(logits[i: i + 1]) for i in rows])
            spent += time.perf_counter() - start
            row_steps += len(rows)
            for i in rows:
                constraints[i].advance(docs[i][step])
        return spent / row_steps

    return median_of(lambda: run(False), repeats), median_of(lambda: run(True), repeats)


def decode_step_seconds(model: Any, batch: int, steps: int) -> float:
    """Median seconds of one decode forward at ``batch`` rows after a 32-token prefill (mlx-lm caches)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.ones((batch, 32), dtype=mx.uint32), cache=cache))
    token, times = mx.ones((batch, 1), dtype=mx.uint32), []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1:, :], axis=-1).astype(mx.uint32)  # (batch, 1)
        mx.eval(token)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file whose tokenizer is used (default: the reference)")
    parser.add_argument("--engines", default=",".join(ENGINES),
                        help="comma-separated, of " + ", ".join(ENGINES) + " ('' measures mlxkv's path only)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--walks", type=int, default=5, help="random walks per tricky schema")
    parser.add_argument("--decode-steps", type=int, default=8, help="0 skips the decode-step measurement")
    args = parser.parse_args()
    blas = ensure_openblas()
    from mlxkv.models import load

    spec = args.model or default_model()
    loaded = load(spec, dequantize=True)
    wrapper = loaded.tokenizer
    hf, eos = wrapper._tokenizer, wrapper.eos_token_id
    vocab, width = len(hf.get_vocab()), loaded.model.args.vocab_size
    words = (vocab + 31) // 32
    print(f"BLAS: {blas}\nversions: {versions()}, numpy {np.__version__}")
    print(f"tokenizer: {os.path.basename(spec)}, vocab {vocab}, logits width {width}, EOS {eos}; "
          f"batch {args.batch}, median of {args.repeats}; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    rng = random.Random(0)
    docs = {name: [wrapper.encode(dumps(instance(s or NESTED, rng)), add_special_tokens=False) + [eos]
                   for _ in range(args.batch)] for name, s in SCHEMAS.items()}

    engines = []
    for name in filter(None, args.engines.split(",")):
        start = time.perf_counter()
        try:
            engine = ENGINES[name](hf, eos, vocab)
        except ImportError as exc:
            print(f"{name}: skipped ({exc})")
            continue
        engines.append(engine)
        print(f"{name} {engine.version}: tokenizer setup {time.perf_counter() - start:.2f} s")

    print("\ncompile ms (median; first mask after it in brackets)")
    print(f"{'schema':<14}" + "".join(f"{e.name:>26}" for e in engines))
    compiled = {}
    for sname, schema in SCHEMAS.items():
        cells = []
        for e in engines:
            def once() -> tuple[float, float]:
                start = time.perf_counter()
                c = e.compile(schema)
                mid = time.perf_counter()
                e.fill([e.matcher(c)], np.zeros((1, words), dtype=np.int32))
                compiled[e.name, sname] = c
                return mid - start, time.perf_counter() - mid
            try:
                runs = [once() for _ in range(args.repeats)]
                cells.append(f"{statistics.median(r[0] for r in runs) * 1e3:9.1f} [{statistics.median(r[1] for r in runs) * 1e3:7.2f}]")
            except Exception as exc:  # noqa: BLE001
                cells.append(f"failed: {str(exc)[:16]}")
        print(f"{sname:<14}" + "".join(f"{c:>26}" for c in cells))

    print(f"\nmask us per row-step at batch {args.batch} (row by row | engine batch API); canonical tokens forbidden")
    for sname in SCHEMAS:
        cells = []
        for e in engines:
            if (e.name, sname) not in compiled:
                cells.append("-")
                continue
            c = compiled[e.name, sname]
            serial = [lockstep(e, c, docs[sname], words, False) for _ in range(args.repeats)]
            batch = [lockstep(e, c, docs[sname], words, True) for _ in range(args.repeats)] if e.fill_batch else []
            med = statistics.median(s for s, _ in serial) * 1e6
            bmed = f"{statistics.median(s for s, _ in batch) * 1e6:.0f}" if batch else "n/a"
            cells.append(f"{med:7.0f} | {bmed:>5} ({max(f for _, f in serial)})")
        print(f"{sname:<14}" + "".join(f"{c:>26}" for c in cells))

    print("\ncorrectness on tricky schemas")
    for name, schema, valid, invalid in TRICKY:
        results = [check_case(e, schema, valid, invalid, wrapper, eos, words, rng, args.walks) for e in engines]
        print(f"  {name}:")
        for e, r in zip(engines, results):
            print(f"    {e.name:<14} {r}")

    per_row, batched = mlxkv_mask_apply(wrapper, docs["nested"], width, args.repeats)
    print(f"\nmlxkv.structured (llguidance), nested schema, mask + apply evaluated, per row-step: {per_row * 1e6:.0f} us "
          f"row by row, {batched * 1e6:.0f} us with one op for the batch")
    if args.decode_steps:
        for b in (1, args.batch):
            step = decode_step_seconds(loaded.model, b, args.decode_steps)
            cost = batched * b if b > 1 else per_row
            print(f"decode step at batch {b}: {step * 1e3:.1f} ms; masks for its {b} row(s): {cost * 1e3:.2f} ms = "
                  f"{cost / (step + cost):.1%} of a constrained step if not overlapped with the forward")

if __name__ == "__main__":
    main()
