"""Sampling controls on the real model (SmolLM2-135M-Instruct, float32) against mlx_lm.server on the same request.

``mlxkv serve`` runs in this process on the GGUF (``--dequantize``); mlx_lm.server runs in a subprocess on the
float32 folder ``mlxkv convert --dequantize`` writes (the weights are the same). Greedy chat completions with
penalties and logit_bias must come back with the same text from both, and differ from the unpenalized one. The
log-probabilities of a greedy answer add up to the model's teacher-forced log-likelihood of it. Needs
``MLXKV_TEST_GGUF`` (see tests/test_real_model.py); run with OpenBLAS preloaded for speed.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import tempfile
import time

import httpx
import mlx.core as mx
import pytest
from testkit.real_model import GGUF

pytestmark = [pytest.mark.real_model, pytest.mark.server]
MESSAGES = [{"role": "user", "content": "List three uses of a hash table, one per line."}]
TOKENS = 32


@pytest.fixture(scope="module")
def mlx_lm_server(smollm2_f32_folder):
    """``mlx_lm.server`` on the float32 folder; yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", str(smollm2_f32_folder),
                             "--host", "127.0.0.1",
                             "--port", str(port), "--log-level", "WARNING"], stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"mlx_lm.server exited: {log.seek(0) or log.read()[-2000:]}"
            try:
                if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "mlx_lm.server did not come up"
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def ours():
    from mlxkv.config import EngineConfig
    from mlxkv.server.runner import ServerThread, build
    from testkit.run_config import run_config

    parts = build(run_config(str(GGUF), dequantize=True, engine=EngineConfig(max_sequences=2), kv_backend="paged"))
    with ServerThread(parts.app) as srv:
        srv.parts = parts
        yield srv


def chat(url: str, model: str, **fields) -> str:
    body = {"model": model, "messages": MESSAGES, "max_tokens": TOKENS, "temperature": 0, **fields}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def test_penalties_and_logit_bias_change_greedy_output_as_mlx_lm_server_does(ours, mlx_lm_server,
                                                                             smollm2_f32_folder):
    tokenizer = ours.parts.loaded.tokenizer
    newline, the = tokenizer.encode("\n", add_special_tokens=False)[0], tokenizer.encode(" the",
                                                                                        add_special_tokens=False)[0]
    plain = chat(ours.url, "smollm2")
    assert plain == chat(mlx_lm_server, str(smollm2_f32_folder))
    for fields in ({"presence_penalty": 1.5}, {"frequency_penalty": 1.0, "presence_penalty": 0.5},
                   {"repetition_penalty": 1.5}, {"logit_bias": {str(newline): -100, str(the): 3.0}}):
        text = chat(ours.url, "smollm2", **fields)
        assert text == chat(mlx_lm_server, str(smollm2_f32_folder), **fields) and text != plain, fields


def test_greedy_logprobs_add_up_to_the_teacher_forced_log_likelihood(ours):
    from mlxkv.engine.direct import DirectEngine
    from mlxkv.engine.sampling import SamplingParams

    loaded = ours.parts.loaded
    r = httpx.post(ours.url + "/v1/chat/completions", timeout=600, json={
        "messages": MESSAGES, "max_tokens": TOKENS, "temperature": 0, "logprobs": True, "top_logprobs": 5}).json()
    content = r["choices"][0]["logprobs"]["content"]
    prompt = list(loaded.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))
    tokens = list(DirectEngine(loaded.model, loaded.tokenizer).generate_tokens(prompt, SamplingParams(TOKENS)))
    assert len(content) == len(tokens) == TOKENS  # no EOS within the budget
    logits = loaded.model(mx.array([prompt + tokens]))[0]  # (P + T, vocab)
    rows = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[len(prompt) - 1 : -1]  # (T, vocab)
    forced = mx.take_along_axis(rows, mx.array(tokens)[:, None], axis=-1).sum().item()
    assert sum(e["logprob"] for e in content) == pytest.approx(forced, abs=1e-4)
    for entry in content:
        top = [t["logprob"] for t in entry["top_logprobs"]]
        assert top == sorted(top, reverse=True) and entry["top_logprobs"][0]["token"] == entry["token"]
