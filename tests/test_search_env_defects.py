"""Defects of the search environment found by running Search-R1's own client and server against tether:
BM25 padding its top k with zero-score passages, gold recall read as 0 against a server whose documents
carry no id, and observations that were not byte-identical to Search-R1's."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from search_helpers import SEARCH_DIR, needs_data, synthetic_corpus
from tether.eval.search import gold_recall, search_metrics
from tether.search.corpus import load_corpus
from tether.search.protocol import render_observation
from tether.search.retrievers import BM25Retriever, HTTPRetriever
from tether.tasks import Example

# ---------------------------------------------------------------- BM25: only matching passages


@pytest.fixture(scope="module")
def shared_bm25(tmp_path_factory):
    if SEARCH_DIR is None:
        pytest.skip("shared search data not found")
    return BM25Retriever(SEARCH_DIR / "corpus.jsonl", cache_dir=tmp_path_factory.mktemp("bm25cache"))


@needs_data
def test_bm25_returns_only_matching_passages_on_the_shared_pool(shared_bm25):
    # "Porcaro" is in one paragraph only: one passage, not one plus four zero-score ones
    porcaro = shared_bm25.search(["Porcaro"], 5)[0]
    assert [p.id for p in porcaro] == ["0"] and porcaro[0].title == "Jeff Porcaro" and porcaro[0].score > 0
    # stop words only, or words in no paragraph: nothing (the corpus begins with a dev question's gold
    # paragraphs, which padding in corpus order used to hand out, inflating gold recall)
    assert shared_bm25.search(["the", "of the and", "zzyzxq qqxxv"], 3) == [[], [], []]
    many = shared_bm25.search(["Toto drummer"], 5)[0]
    assert len(many) == 5 and all(p.score > 0 for p in many)


# ---------------------------------------------------------------- exact Search-R1 observations


@needs_data
def test_observation_bytes_for_two_shared_corpus_rows():
    corpus = load_corpus(SEARCH_DIR / "corpus.jsonl")
    ps = [corpus.passage(corpus.index_of("8915"), 2.0), corpus.passage(corpus.index_of("7440"), 1.0)]
    assert [p.contents for p in ps] == ['"To You"\nTo You may refer to:', '"Arugba"\nArugba is a 2008 film.']
    assert render_observation(ps).encode("utf-8") == (
        b'\n\n<information>Doc 1(Title: "To You") To You may refer to:\n'
        b'Doc 2(Title: "Arugba") Arugba is a 2008 film.</information>\n\n')
    assert render_observation(ps, format="clean").encode("utf-8") == (
        b"\n\n<information>Doc 1(Title: To You) To You may refer to:\n"
        b"Doc 2(Title: Arugba) Arugba is a 2008 film.</information>\n\n")
    # the one the docs show: the title keeps its quotes, as Search-R1 shows it
    smith = corpus.passage(corpus.index_of("8"))
    assert render_observation([smith]).startswith('\n\n<information>Doc 1(Title: "Steve Smith (musician)") Steven ')


# ---------------------------------------------------------------- a Search-R1-style server without ids


class _SearchR1BM25Handler(BaseHTTPRequestHandler):
    """Answers like Search-R1's BM25 ``retrieval_server.py``: documents ``{"title", "text", "contents"}``,
    no ``id``; ``title_text_only`` leaves ``contents`` out too."""

    retriever: BM25Retriever
    title_text_only = False

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        result = []
        for row in self.retriever.search(body["queries"], body.get("topk", 3)):
            docs = []
            for p in row:
                title, _, text = p.contents.partition("\n")
                doc = {"title": title.strip('"'), "text": text}
                if not self.title_text_only:
                    doc["contents"] = p.contents
                docs.append({"document": doc, "score": p.score} if body.get("return_scores") else doc)
            result.append(docs)
        data = json.dumps({"result": result}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def idless_server(tmp_path):
    corpus = synthetic_corpus(tmp_path / "corpus.jsonl", n=20)
    local = BM25Retriever(corpus, cache_dir=tmp_path / "cache")
    handler = type("Handler", (_SearchR1BM25Handler,), {"retriever": local})
    httpd = HTTPServer(("127.0.0.1", 0), handler)
    httpd.timeout = 10
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield {"url": f"http://127.0.0.1:{httpd.server_address[1]}", "corpus": corpus, "local": local,
               "handler": handler}
    finally:
        httpd.shutdown()
        httpd.server_close()
        t.join(timeout=10)


def _rows_and_examples(results, gold):
    """One question per query, gold = its supporting ids, 'retrieved' = the ids the agent would record."""
    exs = [Example(prompt="q", answer="x", id=f"q{i}", meta={"golden_answers": ["x"], "data_source": "s",
                                                            "supporting_ids": g}) for i, g in enumerate(gold)]
    rows = [{"id": f"q{i}", "responses": ["<answer> x </answer>"],
             "info": [{"searches": 1, "retrieved": [p.id for p in r]}]} for i, r in enumerate(results)]
    return rows, exs


def test_gold_recall_is_unknown_not_zero_against_a_server_without_ids(idless_server):
    queries = ["item3", "item5 river", "the"]
    gold = [["p3"], ["p5", "p11"], ["p0"]]
    expected = idless_server["local"].search(queries, 3)
    assert [len(r) for r in expected] == [1, 3, 0]
    client = HTTPRetriever(idless_server["url"], timeout=10, retries=0)
    remote = client.search(queries, 3)
    assert [[p.id for p in r] for r in remote] == [[""], ["", "", ""], []]
    # the observation is the same bytes as the local one: it is built from contents, not ids
    assert [render_observation(r) for r in remote] == [render_observation(r) for r in expected]
    m = search_metrics(*_rows_and_examples(remote, gold))
    # two responses saw id-less passages: unknown, not 0; the third saw nothing: a known 0
    assert m["gold_recall_unknown"] == 2.0 and m["s/gold_recall_unknown"] == 2.0
    assert m["gold_recall"] == 0.0 and m["em"] == 1.0
    only_unknown = search_metrics(*_rows_and_examples(remote[:2], gold[:2]))
    assert "gold_recall" not in only_unknown and only_unknown["gold_recall_unknown"] == 2.0

    # given the corpus the server indexes, the client recovers the ids and the recall is measured
    named = HTTPRetriever(idless_server["url"], timeout=10, retries=0, corpus=idless_server["corpus"])
    resolved = named.search(queries, 3)
    assert [[p.id for p in r] for r in resolved] == [[p.id for p in r] for r in expected]
    m2 = search_metrics(*_rows_and_examples(resolved, gold))
    truth = search_metrics(*_rows_and_examples(expected, gold))
    assert "gold_recall_unknown" not in m2 and m2["gold_recall"] == truth["gold_recall"]
    assert truth["gold_recall"] == pytest.approx((1 + 0.5 + 0) / 3)  # item5 river: p5 in, p11 not


def test_ids_recovered_from_title_and_text_when_the_server_sends_no_contents(idless_server):
    idless_server["handler"].title_text_only = True
    named = HTTPRetriever(idless_server["url"], timeout=10, retries=0, corpus=load_corpus(idless_server["corpus"]))
    got = named.search(["item7", "item12 comet"], 2)
    assert [[p.id for p in r] for r in got] == [[p.id for p in r] for r in idless_server["local"].search(
        ["item7", "item12 comet"], 2)]
    assert got[0][0].id == "p7"


def test_gold_recall_rule():
    assert gold_recall({"a", "b"}, ["a", "x"]) == 0.5
    assert gold_recall({"a", "b"}, []) == 0.0
    assert gold_recall({"a", "b"}, ["a", ""]) is None  # "" might be b
    assert gold_recall({"a", "b"}, ["a", None, "b"]) == 1.0  # every gold seen: unknowns cannot change it
    assert gold_recall({"a"}, ["", ""]) is None
    assert not math.isnan(gold_recall({"a"}, ["b"]))
