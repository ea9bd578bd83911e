"""Pooling models on real servers, through the official openai client and httpx: embeddings
(float and base64) equal sentence-transformers' ``encode``, scores and reranking equal
``CrossEncoder.predict``, every-token states cross the transport out of band, and bad input
gets a clear 4xx in OpenAI's error format."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest

from tests.support.http import assert_openai_error
from tests.support.metrics import parse_metrics
from tests.support.pooling_models import (
    SENTENCES,
    bert_classifier,
    bert_cross_encoder,
    bert_embedder,
    llama_embedder,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

COSINE = 0.99999


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pooling-server")
    return {
        "bert": bert_embedder(root / "bert", "mean"),
        "cross": bert_cross_encoder(root / "cross"),
        "llama": llama_embedder(root / "llama", "lasttoken"),
        "classifier": bert_classifier(root / "classifier"),
    }


@pytest.fixture(scope="module")
def bert(module_server_factory, dirs):
    return module_server_factory(["--model", dirs["bert"], "--served-model-name", "bert"])


@pytest.fixture(scope="module")
def cross(module_server_factory, dirs):
    return module_server_factory(["--model", dirs["cross"], "--served-model-name", "cross"])


@pytest.fixture(scope="module")
def llama(module_server_factory, dirs):
    # Small steps: prompts arrive in chunks and many requests share each step.
    return module_server_factory(
        ["--model", dirs["llama"], "--served-model-name", "llama", "--max-num-batched-tokens", "16"]
    )


def _cosines(ours: np.ndarray, reference: np.ndarray) -> np.ndarray:
    return (ours * reference).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(reference, axis=1)


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
@pytest.mark.parametrize("which", ["bert", "llama"])
def test_embeddings_equal_sentence_transformers(request, dirs, which, encoding_format):
    from sentence_transformers import SentenceTransformer

    server = request.getfixturevalue(which)
    reference = SentenceTransformer(dirs[which], device="cpu").encode(SENTENCES)
    # The client asks for base64 itself unless told otherwise, and decodes it to floats.
    kwargs = {"encoding_format": "float"} if encoding_format == "float" else {}
    result = server.openai().embeddings.create(model=which, input=SENTENCES, **kwargs)
    assert [d.index for d in result.data] == list(range(len(SENTENCES)))
    ours = np.array([d.embedding for d in result.data], dtype=np.float32)
    assert (_cosines(ours, reference) >= COSINE).all()
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    tokenizer = SentenceTransformer(dirs[which], device="cpu").tokenizer
    assert result.usage.prompt_tokens == sum(len(tokenizer(s)["input_ids"]) for s in SENTENCES)
    assert result.usage.total_tokens == result.usage.prompt_tokens


def test_an_encoder_is_served_by_one_engine_process_of_its_own(bert):
    """The engine process that ``python -m app`` starts before it reads its arguments loads torch
    with a decoder's thread-pool settings (core/engine_process.py's EarlyEngine): for an encoder,
    whose OpenMP threads wait otherwise, it is stopped and another started. One engine serves;
    the early one does not linger beside it."""
    assert len(bert.engine_pids()) == 1
    assert bert.openai().embeddings.create(model="bert", input="cat", encoding_format="float").data


def test_base64_decodes_to_the_same_floats(bert):
    """One input per request: a prompt alone in its step gets the same bits every time (in a
    batch, the prompts beside it may change the rounding)."""
    for text in SENTENCES[:3]:
        body = {"model": "bert", "input": text}
        floats = httpx.post(bert.base_url + "/v1/embeddings", json={**body, "encoding_format": "float"}).json()
        packed = httpx.post(bert.base_url + "/v1/embeddings", json={**body, "encoding_format": "base64"}).json()
        decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.array(floats["data"][0]["embedding"], dtype=np.float32))


def test_token_id_inputs_equal_text_inputs(bert, dirs):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(dirs["bert"])
    ids = [tokenizer(s)["input_ids"] for s in SENTENCES[:3]]
    client = bert.openai()
    by_text = client.embeddings.create(model="bert", input=SENTENCES[:3], encoding_format="float")
    by_ids = client.embeddings.create(model="bert", input=ids, encoding_format="float")
    one = client.embeddings.create(model="bert", input=ids[0], encoding_format="float")
    one_text = client.embeddings.create(model="bert", input=SENTENCES[0], encoding_format="float")
    assert one.data[0].embedding == one_text.data[0].embedding  # alone in its step: the same bits
    # In a batch the engine may split the inputs over steps differently each time, and the prompts
    # beside one change its rounding: the same vector up to that.
    for got, want in zip([*by_ids.data, one.data[0]], [*by_text.data, by_text.data[0]]):
        np.testing.assert_allclose(got.embedding, want.embedding, rtol=1e-5, atol=1e-7)


def test_many_inputs_in_one_request_are_batched_and_leave_nothing_behind(llama, dirs):
    from sentence_transformers import SentenceTransformer

    texts = [f"{SENTENCES[i % len(SENTENCES)]} {i}" for i in range(300)]
    result = llama.openai().embeddings.create(model="llama", input=texts, encoding_format="float")
    reference = SentenceTransformer(dirs["llama"], device="cpu").encode(texts)
    ours = np.array([d.embedding for d in result.data], dtype=np.float32)
    assert (_cosines(ours, reference) >= COSINE).all()
    # Every request finished and freed its blocks.
    stats = llama.engine_stats()
    assert stats["num_running_reqs"] == 0 and stats["num_waiting_reqs"] == 0
    assert stats["kv_cache_usage"] == 0.0


def test_bad_embedding_requests_get_clear_errors(bert):
    url = bert.base_url + "/v1/embeddings"
    cases = [
        ({"input": []}, "input must not be empty"),
        ({"input": [[]]}, "token list is empty"),
        ({"input": [[10**6]]}, "out of vocabulary"),
        ({"input": ["cat " * 200]}, "maximum context length is 128"),
        ({"input": ["cat"] * 10_000}, "at most 2048"),
        ({"input": "cat", "dimensions": 16}, "Matryoshka"),
        ({"input": "cat", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "cat", "temperature": 0.5}, "unknown field `temperature`"),
        ({"input": [1.5]}, "input must be"),
    ]
    for body, needle in cases:
        assert_openai_error(httpx.post(url, json={"model": "bert", **body}, timeout=60), 400, "BadRequestError", needle)
    assert_openai_error(
        httpx.post(url, json={"model": "nope", "input": "cat"}), 404, "NotFoundError", "does not exist"
    )


def test_pooling_model_refuses_generation_and_generation_model_refuses_embeddings(bert, cross, module_server_factory):
    server = module_server_factory([])  # the embedded stories260K: a generative model
    assert_openai_error(
        httpx.post(bert.base_url + "/v1/completions", json={"model": "bert", "prompt": "the cat"}),
        400, "BadRequestError", "pooling model",
    )
    assert_openai_error(
        httpx.post(server.base_url + "/v1/embeddings", json={"input": "Once upon a time"}),
        400, "BadRequestError", "generates text",
    )
    assert_openai_error(
        httpx.post(cross.base_url + "/v1/embeddings", json={"input": "the cat"}),
        400, "BadRequestError", "classifier",
    )


def test_scores_equal_cross_encoder_predict(cross, dirs):
    from sentence_transformers import CrossEncoder

    query, documents = SENTENCES[5], SENTENCES[:8]
    reference = CrossEncoder(dirs["cross"], device="cpu").predict([(query, d) for d in documents])
    body = httpx.post(cross.base_url + "/score", json={"model": "cross", "text_1": query, "text_2": documents}).json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(documents)))
    np.testing.assert_allclose([d["score"] for d in body["data"]], reference, rtol=1e-4, atol=1e-6)
    assert body["usage"]["prompt_tokens"] > 0
    # Pairwise lists, on the /v1 path.
    pairs = httpx.post(
        cross.base_url + "/v1/score", json={"text_1": [query] * 3, "text_2": documents[:3]}
    ).json()
    np.testing.assert_allclose([d["score"] for d in pairs["data"]], reference[:3], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_as_cross_encoder(cross, dirs, path):
    from sentence_transformers import CrossEncoder

    query, documents = SENTENCES[5], SENTENCES[:8]
    reference = CrossEncoder(dirs["cross"], device="cpu").predict([(query, d) for d in documents])
    body = httpx.post(
        cross.base_url + path, json={"model": "cross", "query": query, "documents": documents, "top_n": 3}
    ).json()
    expected = np.argsort(-reference, kind="stable")[:3].tolist()
    assert [r["index"] for r in body["results"]] == expected
    for r in body["results"]:
        assert r["document"]["text"] == documents[r["index"]]
        assert r["relevance_score"] == pytest.approx(float(reference[r["index"]]), rel=1e-4, abs=1e-6)
    bare = httpx.post(cross.base_url + path, json={"query": query, "documents": documents, "return_documents": False})
    assert all("document" not in r for r in bare.json()["results"]) and len(bare.json()["results"]) == 8


def test_bad_score_and_rerank_requests(cross):
    assert_openai_error(
        httpx.post(cross.base_url + "/score", json={"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}),
        400, "BadRequestError", "as many as text_2",
    )
    assert_openai_error(
        httpx.post(cross.base_url + "/rerank", json={"query": "a", "documents": []}), 400, "BadRequestError", "empty"
    )
    assert_openai_error(
        httpx.post(cross.base_url + "/rerank", json={"query": "a", "documents": ["b"], "top_n": 0}),
        400, "BadRequestError", "top_n",
    )


def test_score_with_an_embedding_model_is_the_cosine_of_embeddings(bert, dirs):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(dirs["bert"], device="cpu")
    query, documents = SENTENCES[0], SENTENCES[1:5]
    reference = model.encode(documents) @ model.encode(query)
    body = httpx.post(bert.base_url + "/score", json={"text_1": query, "text_2": documents}).json()
    np.testing.assert_allclose([d["score"] for d in body["data"]], reference, rtol=1e-4, atol=1e-5)


def test_every_token_state_travels_out_of_band(module_server_factory, dirs):
    """ALL pooling of a long input: a [tokens, hidden] tensor, far over the inline threshold, which
    the engine hands over through the shared-memory tensor pool (its bytes counted as such)."""
    import transformers

    override = json.dumps({"pooling_type": "ALL", "normalize": False})
    server = module_server_factory(["--model", dirs["bert"], "--override-pooler-config", override])
    text = " ".join(SENTENCES)[:300]

    def oob_bytes_from_engine() -> float:
        samples = parse_metrics(httpx.get(server.base_url + "/metrics").text)
        return sum(v for (name, labels), v in samples.items()
                   if name == "ringllm:transport_oob_bytes_total" and dict(labels).get("direction") == "to_frontend")

    before = oob_bytes_from_engine()
    body = httpx.post(server.base_url + "/pooling", json={"input": text}, timeout=60).json()
    ours = np.array(body["data"][0]["data"], dtype=np.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(dirs["bert"])
    hf = transformers.BertModel.from_pretrained(dirs["bert"]).eval()
    import torch

    with torch.no_grad():
        reference = hf(**tokenizer(text, return_tensors="pt")).last_hidden_state[0].numpy()
    np.testing.assert_allclose(ours, reference, rtol=1e-4, atol=1e-5)
    # The engine's counters ride on its later outputs: one more request carries them.
    httpx.post(server.base_url + "/pooling", json={"input": "cat"}, timeout=60).raise_for_status()
    wait_for(lambda: oob_bytes_from_engine() - before >= reference.nbytes, "the tensor's bytes counted out of band")


def test_truncated_inputs_equal_sentence_transformers_cut_to_max_seq_length(bert, cross, dirs):
    """truncate_prompt_tokens: a text keeps its special tokens and loses its end, as
    sentence-transformers cuts to max_seq_length (embeddings) and CrossEncoder to max_length (pairs)."""
    from sentence_transformers import CrossEncoder, SentenceTransformer

    long_texts = [" ".join(SENTENCES[i:] + SENTENCES[:i]) for i in range(4)]
    model = SentenceTransformer(dirs["bert"], device="cpu")
    model.max_seq_length = 12
    result = bert.openai().embeddings.create(
        model="bert", input=long_texts, encoding_format="float", extra_body={"truncate_prompt_tokens": 12}
    )
    ours = np.array([d.embedding for d in result.data], dtype=np.float32)
    assert (_cosines(ours, model.encode(long_texts)) >= COSINE).all()
    assert result.usage.prompt_tokens == 12 * len(long_texts)
    # -1: the model's context (128 tokens), where the whole text would not fit.
    model.max_seq_length = 128
    whole = httpx.post(bert.base_url + "/v1/embeddings", json={"input": ["cat " * 200], "truncate_prompt_tokens": -1})
    assert whole.json()["usage"]["prompt_tokens"] == 128
    assert _cosines(np.array([whole.json()["data"][0]["embedding"]]), model.encode(["cat " * 200]))[0] >= COSINE
    # Pairs: the longer text is cut first.
    query, documents = SENTENCES[5], long_texts
    reference = CrossEncoder(dirs["cross"], device="cpu", max_length=16).predict([(query, d) for d in documents])
    body = httpx.post(
        cross.base_url + "/score", json={"text_1": query, "text_2": documents, "truncate_prompt_tokens": 16}
    ).json()
    np.testing.assert_allclose([d["score"] for d in body["data"]], reference, rtol=1e-4, atol=1e-6)
    # Token ids given as such keep their first tokens.
    ids = list(range(5, 40))
    cut = httpx.post(bert.base_url + "/v1/embeddings", json={"input": [ids], "truncate_prompt_tokens": 10}).json()
    first = httpx.post(bert.base_url + "/v1/embeddings", json={"input": [ids[:10]]}).json()
    np.testing.assert_allclose(cut["data"][0]["embedding"], first["data"][0]["embedding"], rtol=1e-5, atol=1e-7)
    for bad in (0, -2, 10**6):
        assert_openai_error(
            httpx.post(bert.base_url + "/v1/embeddings", json={"input": "cat", "truncate_prompt_tokens": bad}),
            400, "BadRequestError", "truncate_prompt_tokens",
        )


def test_classify_gives_transformers_class_probabilities(module_server_factory, dirs, bert):
    """vLLM's /classify on a three-label classifier: softmax of transformers' logits, the label by name."""
    import torch
    import transformers

    server = module_server_factory(["--model", dirs["classifier"], "--served-model-name", "classifier"])
    body = httpx.post(server.base_url + "/classify", json={"model": "classifier", "input": SENTENCES[:4]}).json()
    model = transformers.BertForSequenceClassification.from_pretrained(dirs["classifier"]).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(dirs["classifier"])
    for item, text in zip(body["data"], SENTENCES[:4]):
        with torch.no_grad():
            probs = torch.softmax(model(**tokenizer(text, return_tensors="pt")).logits[0], -1).numpy()
        np.testing.assert_allclose(item["probs"], probs, rtol=1e-4, atol=1e-6)
        assert item["label"] == model.config.id2label[int(probs.argmax())] and item["num_classes"] == 3
    assert body["usage"]["prompt_tokens"] > 0
    assert_openai_error(
        httpx.post(bert.base_url + "/classify", json={"input": "the cat"}), 400, "BadRequestError", "no classification"
    )


def test_openapi_document_references_resolve(bert):
    """Every $ref of /openapi.json names a schema it defines (generic responses included)."""
    import re

    document = httpx.get(bert.base_url + "/openapi.json").json()
    refs = set(re.findall(r'"#/components/schemas/([^"]+)"', json.dumps(document)))
    assert refs and refs <= set(document["components"]["schemas"])
    assert {"/v1/embeddings", "/pooling", "/classify", "/score", "/rerank"} <= set(document["paths"])
