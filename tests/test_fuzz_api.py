"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis), against
a real engine: valid and invalid bodies alike never get a 5xx, and the server is healthy and
exact afterwards. Bounded: 15 examples per operation and mode, small max_tokens."""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from actors.config import EngineConfig
from app.api.app import attach, build_api
from app.api.embedded import serve_in_thread
from app.api.engine_client import LocalEngineClient
from app.api.settings import ServerSettings

EXAMPLES = 15  # per operation and generation mode


@pytest.fixture(scope="module")
def served(llama_ckpt):
    client = LocalEngineClient(EngineConfig(model_path=str(llama_ckpt), num_kv_blocks=256))
    # Tight limits keep every generated request quick (the fuzzing is about inputs).
    settings_ = ServerSettings(model_path=str(llama_ckpt), max_tokens_cap=8, max_n=2, max_prompts=4)
    try:
        with serve_in_thread(attach(build_api(settings_), client, client.tokenizer, settings_)) as url:
            yield url
    finally:
        client.shutdown()


def operations(url: str) -> list:
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_input_gets_a_server_error(served, mode):
    """Every operation of the OpenAPI schema, with bodies, queries and paths generated from it
    (valid ones, then invalid ones); 0 responses >= 500."""
    seen = []

    for op in operations(served):
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def one(case):
            response = case.call(base_url=served, timeout=60)
            seen.append(response.status_code)
            assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])

        try:
            one()
        except Unsatisfiable:  # an operation with no input to make invalid (e.g. GET /healthz)
            assert mode is GenerationMode.NEGATIVE
    print(f"{mode.value}: {len(seen)} requests, statuses {sorted(set(seen))}")
    assert len(seen) >= EXAMPLES


def test_server_is_healthy_and_exact_after_fuzzing(served, llama_ckpt):
    from oracle import hf_greedy

    assert httpx.get(f"{served}/readyz", timeout=10).status_code == 200
    ids = [11, 42, 7, 99, 3]
    r = httpx.post(f"{served}/v1/completions", timeout=60, json={
        "model": "", "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True})
    assert r.json()["choices"][0]["token_ids"] == hf_greedy(llama_ckpt, ids, 8)
    (replica,) = httpx.get(f"{served}/stats", timeout=10).json()["replicas"]
    assert replica["kv_blocks_free"] == replica["kv_blocks_total"]
