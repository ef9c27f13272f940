"""Embeddings: the engine's pooled vectors equal transformers' final hidden states pooled the
same way (float32, within 1e-5) through chunked prefill, prefix-cache hits and preemption, and
/v1/embeddings serves them in OpenAI's shape over real HTTP (uvicorn on 127.0.0.1, a real
engine on a tiny checkpoint, the `openai` client and raw httpx).
"""
from __future__ import annotations

import base64
import json
import shutil

import httpx
import numpy as np
import openai
import pytest
import torch
from oracle import hf_greedy, hf_hidden_states
from test_api import running
from test_engine import assert_pool_free, prompts_of

from actors.config import EngineConfig
from actors.engine.llm import LLM
from actors.pooling_params import PoolingParams
from actors.sampling_params import SamplingParams
from actors.worker.pooling_config import DEFAULT, read_pooling
from app.api.app import attach, build_api
from app.api.engine_client import LocalEngineClient
from app.api.settings import ServerSettings

TOLERANCE = 1e-5
MAX_MODEL_LEN = 128


def reference(path, ids: list[int], method: str = "last", normalize: bool = True,
              dimensions: int | None = None) -> torch.Tensor:
    """transformers' final hidden states (after the final norm), pooled as shoal should."""
    hidden = hf_hidden_states(path, ids)
    vector = (hidden.mean(0) if method == "mean" else hidden[-1])[:dimensions]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def assert_close(got: list[float], want: torch.Tensor) -> None:
    assert len(got) == len(want)
    assert (torch.tensor(got) - want).abs().max().item() < TOLERANCE


def write_sentence_transformers(path, method: str | None, normalize: bool, extra: dict | None = None) -> None:
    """modules.json (+ 1_Pooling/config.json) as sentence-transformers saves them."""
    def module(idx: int, folder: str, kind: str) -> dict:
        return {"idx": idx, "name": str(idx), "path": folder, "type": f"sentence_transformers.models.{kind}"}

    modules = [module(0, "", "Transformer")]
    if method is not None:
        modules.append(module(1, "1_Pooling", "Pooling"))
        (path / "1_Pooling").mkdir()
        modes = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": method == "mean",
                 "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": method == "last", **(extra or {})}
        config = {"word_embedding_dimension": 64, **modes}
        (path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    if normalize:
        modules.append(module(2, "2_Normalize", "Normalize"))
    (path / "modules.json").write_text(json.dumps(modules))


# --------------------------------------------------------------------------- the checkpoint's pooling

def test_the_pooling_comes_from_the_sentence_transformers_files(tmp_path):
    assert read_pooling(tmp_path) == DEFAULT == PoolingParams(method="last", normalize=True)  # no files
    cases = {"mean-raw": ("mean", False), "last-raw": ("last", False), "mean-normalized": ("mean", True),
             "no-pooling-module": (None, True)}
    for name, (method, normalize) in cases.items():
        (tmp_path / name).mkdir()
        write_sentence_transformers(tmp_path / name, method, normalize)
        assert read_pooling(tmp_path / name) == PoolingParams(method=method or "last", normalize=normalize)
    (tmp_path / "cls").mkdir()
    write_sentence_transformers(tmp_path / "cls", "mean", True, {"pooling_mode_mean_tokens": False,
                                                                 "pooling_mode_cls_token": True})
    with pytest.raises(ValueError, match="pooling_mode_cls_token"):
        read_pooling(tmp_path / "cls")


# --------------------------------------------------------------------------- the engine

@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "raw"])
@pytest.mark.parametrize("method", ["last", "mean"])
def test_embeddings_equal_transformers_through_chunks_and_the_prefix_cache(llama_ckpt, tmp_path, method,
                                                                           normalize):
    path = tmp_path / "embedder"
    shutil.copytree(llama_ckpt, path)
    write_sentence_transformers(path, method, normalize)
    llm = LLM(str(path), block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)  # 50 tokens: 7 chunks
    [long] = prompts_of([50], seed=1)
    first = llm.embed([long])[0]
    shared = long[:40] + [7, 8, 9]  # its first 10 blocks are cached by now
    second = llm.embed(shared)[0]
    # Last-token pooling takes the cached blocks; mean pooling needs every prompt token's hidden
    # state, so it computes the whole prompt again.
    assert llm.engine.scheduler.hit_tokens == (40 if method == "last" else 0)
    for ids, out in [(long, first), (shared, second)]:
        assert_close(out.embedding, reference(llama_ckpt, ids, method, normalize))
        assert out.prompt_token_ids == ids and out.finished and not out.outputs[0].token_ids
    assert_pool_free(llm)


@pytest.mark.parametrize("method", ["last", "mean"])
def test_a_preempted_embedding_shares_steps_with_generation_and_is_computed_again(llama_ckpt, method):
    """A decode that grows takes the blocks of the embedding prefilling beside it (preempted,
    then recomputed); both still equal transformers."""
    llm = LLM(str(llama_ckpt), block_size=4, num_kv_blocks=10, max_num_batched_tokens=8)
    gen, emb = prompts_of([8, 30], seed=3)
    llm.add_request("gen", gen, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    llm.add_request("emb", emb, SamplingParams(max_tokens=0),
                    pooling=PoolingParams(method=method, normalize=False))
    done = llm.run()
    assert llm.engine.scheduler.num_preemptions > 0
    assert done["gen"].outputs[0].token_ids == hf_greedy(llama_ckpt, gen, 30)
    assert_close(done["emb"].embedding, reference(llama_ckpt, emb, method, normalize=False))
    assert_pool_free(llm)


def test_the_engine_refuses_what_it_cannot_embed(llama_ckpt):
    llm = LLM(str(llama_ckpt), num_kv_blocks=16, max_model_len=MAX_MODEL_LEN)
    for pooling, prompt, why in [(PoolingParams(dimensions=65), [1, 2], "dimensions"),
                                 (PoolingParams(dimensions=0), [1, 2], "dimensions"),
                                 (PoolingParams(), [1] * (MAX_MODEL_LEN + 1), "context length")]:
        with pytest.raises(ValueError, match=why):
            llm.add_request("bad", prompt, SamplingParams(max_tokens=0), pooling=pooling)
    with pytest.raises(ValueError, match="max_tokens=0"):
        llm.add_request("bad", [1, 2], SamplingParams(max_tokens=4), pooling=PoolingParams())
    assert not llm.engine.has_unfinished()


# --------------------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def engine(llama_ckpt):
    client = LocalEngineClient(EngineConfig(model_path=str(llama_ckpt), num_kv_blocks=64,
                                            max_model_len=MAX_MODEL_LEN))
    yield client
    client.shutdown()


@pytest.fixture(scope="module")
def url(engine, llama_ckpt):
    settings = ServerSettings(model_path=str(llama_ckpt))
    with running(attach(build_api(settings), engine, engine.tokenizer, settings)) as base:
        yield base


@pytest.fixture(scope="module")
def model(llama_ckpt):
    return llama_ckpt.name


def embed(url, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/embeddings", json=body, timeout=60)


def encode(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=True)


TEXTS = ["The quick brown fox", "jumps", "over the lazy dog, twice over", "a", "Hello, world"]


def test_a_batch_comes_back_in_order_with_its_usage(url, model, engine, llama_ckpt):
    r = embed(url, input=TEXTS, model=model, user="someone")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == model
    ids = [encode(engine, t) for t in TEXTS]
    tokens = sum(map(len, ids))
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    assert [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
    for d, prompt in zip(body["data"], ids):
        assert d["object"] == "embedding"
        assert_close(d["embedding"], reference(llama_ckpt, prompt))  # the default: last token, normalized
    assert engine.engine.engine.blocks.num_free_blocks == engine.engine.engine.blocks.num_blocks


def test_base64_is_little_endian_float32_as_the_openai_client_decodes_it(url, model):
    floats = embed(url, input=TEXTS[:2], model=model).json()["data"]
    raw = embed(url, input=TEXTS[:2], model=model, encoding_format="base64").json()["data"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    sdk = client.embeddings.create(input=TEXTS[:2], model=model)  # the client asks for base64
    for f, b, s in zip(floats, raw, sdk.data):
        decoded = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
        assert decoded.tolist() == f["embedding"] == s.embedding  # float32 values, exactly


def test_dimensions_keep_the_leading_ones_normalized_again(url, model, engine, llama_ckpt):
    r = embed(url, input=TEXTS[0], model=model, dimensions=16)
    [vector] = [d["embedding"] for d in r.json()["data"]]
    assert_close(vector, reference(llama_ckpt, encode(engine, TEXTS[0]), dimensions=16))
    assert abs(sum(x * x for x in vector) - 1) < TOLERANCE


def test_token_id_inputs(url, model, llama_ckpt):
    one, two = prompts_of([9, 20], seed=5)
    single = embed(url, input=one, model=model).json()
    assert len(single["data"]) == 1 and single["usage"]["prompt_tokens"] == 9
    assert_close(single["data"][0]["embedding"], reference(llama_ckpt, one))
    batch = embed(url, input=[one, two], model=model).json()
    for d, ids in zip(batch["data"], [one, two]):
        assert_close(d["embedding"], reference(llama_ckpt, ids))


@pytest.mark.parametrize("body, status, param", [
    ({"input": []}, 400, "input"),
    ({"input": ""}, 400, "input"),
    ({"input": ["fine", ""]}, 400, "input"),
    ({"input": [[1, 2], []]}, 400, "input"),
    ({"input": ["text", [1, 2]]}, 400, None),  # neither strings nor token ids
    ({}, 400, "input"),
    ({"input": [5] * (MAX_MODEL_LEN + 1)}, 400, "input"),
    ({"input": [[1, 10**6]]}, 400, None),
    ({"input": [-1, 2]}, 400, None),
    ({"input": "hi", "dimensions": 0}, 400, "dimensions"),
    ({"input": "hi", "dimensions": 65}, 400, None),
    ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "hi", "model": "no-such-model"}, 404, "model"),
], ids=["empty-list", "empty-string", "an-empty-string", "empty-ids", "mixed", "missing", "too-long",
        "past-the-vocabulary", "negative-id", "dimensions-0", "dimensions-past-hidden", "bad-format",
        "unknown-model"])
def test_bad_requests_get_an_openai_error(url, body, status, param):
    r = embed(url, **body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] in ("invalid_request_error", "not_found_error")
    if param is not None:
        assert error["param"] == param
