"""The OpenAPI spec fuzzed with schemathesis against a real server on loopback: no input gives a 5xx, nothing leaks.

Schemathesis generates requests for every operation of the server's own ``/openapi.json`` (valid bodies and
bodies that break the schema on purpose); every answer must be a non-5xx status. The model is the tiny test llama
with a 96-token context, so no generated request can run long (a longer prompt is a 400, an answer stops at the
context). Afterwards the engine holds no sequence and the block pool's invariants hold.
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from mlxkv.engine.batch import EngineConfig
from testkit.run_config import run_config
from testkit.serve_thread import serve_in_thread

pytestmark = pytest.mark.server

#: The fuzzed model's context (positions): bounds every generated request's work.
CONTEXT = 96
#: Generated requests per operation and mode (the suite's time budget; each costs a few ms to ~0.3 s).
EXAMPLES = 25


@pytest.fixture(scope="module")
def fuzz_server(test_model_dir, tmp_path_factory):
    model = tmp_path_factory.mktemp("fuzz") / "llama"
    shutil.copytree(test_model_dir("llama"), model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (model / "config.json").write_text(json.dumps(config))
    config = run_config(str(model), engine=EngineConfig(max_sequences=4, max_queue_depth=16), kv_backend="paged")
    with serve_in_thread(config, model_name="tiny-llama") as srv:
        yield srv


def fuzz(operation, mode: GenerationMode, statuses: list[int]) -> None:
    """``EXAMPLES`` generated requests of one operation in one mode (derandomized: the same ones every run)."""

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def call(case):
        response = case.call(timeout=60)
        statuses.append(response.status_code)
        assert response.status_code < 500, (
            f"{case.method} {case.path} ({mode.value}) -> {response.status_code}: {response.text[:300]}; "
            f"body {case.body!r}")

    try:
        call()
    except Unsatisfiable:  # nothing to break in a request without parameters (GET /health)
        assert mode is GenerationMode.NEGATIVE, f"no valid request for {operation.label}"


@pytest.mark.slow
def test_no_generated_request_gets_a_server_error(fuzz_server):
    """Every operation, with schema-valid requests and with requests that break the schema: no 5xx."""
    api = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/models",
                                              "/v1/cache/stats", "/v1/cache/reset", "/health", "/metrics",
                                              "/v1/messages", "/v1/messages/count_tokens"}
    statuses: list[int] = []
    for operation in operations:
        for mode in GenerationMode:
            fuzz(operation, mode, statuses)
    assert len(statuses) >= len(operations) and any(400 <= code < 500 for code in statuses)


def test_after_fuzzing_no_sequence_is_left_and_the_pool_is_consistent(fuzz_server):
    engine, pool = fuzz_server.parts.engine, fuzz_server.parts.engine.pool
    deadline = time.monotonic() + 30
    while engine.stats()["running"] or engine.stats()["prefilling"] or engine.stats()["waiting"]:
        assert time.monotonic() < deadline, "requests still running after the fuzzing"
        time.sleep(0.05)
    assert engine.alive and len(pool) == 0
    pool.check_invariants()
