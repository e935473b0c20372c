"""Pooling models over HTTP, started with vLLM Ascend's tutorial flags: Qwen3-Embedding on
``/v1/embeddings`` (official ``openai`` client, float and base64), Qwen3-Reranker on ``/score``,
``/v1/score``, ``/rerank`` and ``/v1/rerank``; values against Hugging Face on the same tiny
random weights."""

from __future__ import annotations

import json

import pytest
import torch
from oai_server import RemoteServer, started_together

from helpers.tiny_pooling import RERANKER_OVERRIDES, make_tiny_embedding, make_tiny_reranker

TEXTS = ["Hello world! How are you today?", "The capital of France is Paris."]


@pytest.fixture(scope="module")
def pooling_servers(tmp_path_factory):
    """Both servers, started together so their start-ups overlap: (embedder, reranker), each
    (model path, server)."""
    emb_path = make_tiny_embedding(str(tmp_path_factory.mktemp("emb") / "qwen3-embedding"))
    rr_path = make_tiny_reranker(str(tmp_path_factory.mktemp("rr") / "qwen3-reranker"))
    # Qwen3-Embedding.md's Atlas 300I command, with float32 for an exact comparison
    emb_args = [emb_path, "--served-model-name", "Qwen/Qwen3-Embedding-0.6B",
                "--compilation-config", '{"cudagraph_capture_sizes": [1024,512]}',
                "--additional-config", '{"ascend_compilation_config": {"fuse_norm_quant": false}}',
                "--runner", "pooling", "--dtype", "float32", "--max-model-len", "1024",
                "--kv-cache-memory-bytes", "32M", "--max-sequences-per-request", "3"]
    rr_args = [rr_path, "--served-model-name", "Qwen/Qwen3-Reranker-0.6B", "--runner", "pooling",
               "--hf_overrides", json.dumps(RERANKER_OVERRIDES), "--dtype", "float32",
               "--max-model-len", "1024", "--kv-cache-memory-bytes", "32M", "--max-num-seqs", "2",
               "--max-queued-sequences", "1", "--max-sequences-per-request", "4"]
    with started_together({
        "emb": lambda: RemoteServer(emb_args, tmp_path_factory.mktemp("emb-log") / "server.log",
                                    wait=False),
        "rr": lambda: RemoteServer(rr_args, tmp_path_factory.mktemp("rr-log") / "server.log",
                                   wait=False),
    }) as started:
        yield (emb_path, started["emb"]), (rr_path, started["rr"])


@pytest.fixture(scope="module")
def embedder(pooling_servers):
    return pooling_servers[0]


@pytest.fixture(scope="module")
def reranker(pooling_servers):
    return pooling_servers[1]


def hf_embeddings(path: str, texts: list[str]) -> torch.Tensor:
    import transformers as tf

    model = tf.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    tok = tf.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        return torch.stack([model(torch.tensor([tok.encode(t)])).last_hidden_state[0, -1]
                            for t in texts])


def test_openai_client_embeddings_match_hf(embedder):
    path, srv = embedder
    want = torch.nn.functional.normalize(hf_embeddings(path, TEXTS), dim=-1)
    client = srv.client()
    # no encoding_format: the client asks for base64 and decodes it itself
    for kw in ({"encoding_format": "float"}, {}):
        resp = client.embeddings.create(model="Qwen/Qwen3-Embedding-0.6B", input=TEXTS, **kw)
        got = torch.tensor([d.embedding for d in resp.data])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert resp.usage.prompt_tokens == resp.usage.total_tokens > 0
    cut = client.embeddings.create(model="Qwen/Qwen3-Embedding-0.6B", input=TEXTS[0],
                                   dimensions=16)
    torch.testing.assert_close(torch.tensor(cut.data[0].embedding), torch.nn.functional.normalize(
        hf_embeddings(path, TEXTS[:1])[0, :16], dim=0), atol=1e-4, rtol=1e-4)
    log = srv.log()
    assert "cudagraph_capture_sizes=[512, 1024]" in log and "no effect" in log
    assert "ascend_compilation_config" in log


def test_embedding_server_refuses_generation_and_bad_dimensions(embedder):
    _, srv = embedder
    r = srv.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and "pooling model" in r.json()["error"]["message"]
    r = srv.post("/v1/embeddings", json={"input": "hi", "dimensions": 10_000})
    assert r.status_code == 400 and "dimensions" in r.json()["error"]["message"]
    r = srv.post("/v1/embeddings", json={"input": "hi", "model": "other"})
    assert r.status_code == 404


def test_reranker_routes_match_hf_yes_no_probability(reranker):
    import transformers as tf

    path, srv = reranker
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = tf.AutoTokenizer.from_pretrained(path)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    query, docs = "What is the capital of France?", TEXTS

    def hf_score(q: str, d: str) -> float:
        ids = tok(text=q, text_pair=d)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        return float(torch.softmax(logits[[no, yes]], dim=0)[1])

    want = [hf_score(query, d) for d in docs]
    for route in ("/score", "/v1/score"):
        body = srv.post(route, json={"text_1": query, "text_2": docs}).json()
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
    for route in ("/rerank", "/v1/rerank"):
        body = srv.post(route, json={"query": query, "documents": docs, "top_n": 1}).json()
        best = max(range(len(docs)), key=lambda i: want[i])
        assert [r["index"] for r in body["results"]] == [best]
        assert body["results"][0]["relevance_score"] == pytest.approx(want[best], abs=1e-5)
        assert body["results"][0]["document"]["text"] == docs[best]
    r = srv.post("/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400 and "/rerank" in r.json()["error"]["message"]


def test_embedding_model_scores_by_cosine_similarity(embedder):
    path, srv = embedder
    vecs = torch.nn.functional.normalize(hf_embeddings(path, TEXTS), dim=-1)
    body = srv.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS}).json()
    assert [d["score"] for d in body["data"]] == pytest.approx(
        [float(vecs[0] @ vecs[0]), float(vecs[0] @ vecs[1])], abs=1e-4)


def test_generic_pooling_route_on_embedding_and_reranker(embedder, reranker):
    """vLLM's /pooling serves these models too: the embedding (normalized unless
    use_activation is false) and the reranker's [score]."""
    path, emb = embedder
    raw = hf_embeddings(path, TEXTS[:1])[0]
    body = emb.post("/pooling", json={"input": TEXTS[0]}).json()
    torch.testing.assert_close(torch.tensor(body["data"][0]["data"]),
                               torch.nn.functional.normalize(raw, dim=0), atol=1e-4, rtol=1e-4)
    body = emb.post("/pooling", json={"input": TEXTS[0], "use_activation": False}).json()
    torch.testing.assert_close(torch.tensor(body["data"][0]["data"]), raw, atol=1e-4, rtol=1e-4)
    r = emb.post("/pooling", json={"input": "hi", "task": "token_classify"})
    assert r.status_code == 400 and "Supported tasks: ['embed']" in r.text
    _, rr = reranker
    ids = rr.post("/tokenize", json={"prompt": "hi"}).json()["tokens"]
    score = rr.post("/pooling", json={"input": ids}).json()["data"][0]["data"]
    assert len(score) == 1 and 0 < score[0] < 1


def test_pooling_routes_go_through_the_admission_caps(embedder, reranker):
    """Each prompt is one sequence: over --max-sequences-per-request is a 400, past what may
    run (--max-num-seqs 2) plus wait (--max-queued-sequences 1) a 429; refused and finished
    requests give their reservations back."""
    _, emb = embedder
    r = emb.post("/v1/embeddings", json={"input": ["a", "b", "c", "d"]})
    assert r.status_code == 400 and "--max-sequences-per-request" in r.text, r.text
    assert "4 sequences" in r.json()["error"]["message"]
    _, srv = reranker
    docs = ["one", "two", "three", "four", "five"]
    r = srv.post("/rerank", json={"query": "q", "documents": docs})
    assert r.status_code == 400 and "--max-sequences-per-request" in r.text, r.text
    r = srv.post("/score", json={"text_1": "q", "text_2": docs[:4]})
    assert r.status_code == 429 and "--max-queued-sequences" in r.text, r.text
    for _ in range(3):  # a leaked reservation would turn the last into a 429
        assert srv.post("/v1/rerank", json={"query": "q", "documents": docs[:2]}).status_code \
            == 200
    r = srv.post("/v1/score", json={"text_1": "q", "text_2": docs[:3]})  # all the room there is
    assert r.status_code == 200 and len(r.json()["data"]) == 3
