"""`tether eval --agent search`: EM/F1 per data_source, searches, answered rate and gold recall, with BM25 in
process and with the http retriever against a real `tether retrieve serve` process."""

from __future__ import annotations

import json

import pytest

from search_helpers import shared_search_dir, synthetic_corpus
from test_search_server import server  # noqa: F401  (the fixture: a real server subprocess)
from tether.cli import main
from tether.eval.search import search_metrics
from tether.tasks import Example


def _qa(path, n=4):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"question": f"question {i}?", "golden_answers": [f"ans {i}", "alias"],
                                "data_source": "even" if i % 2 == 0 else "odd",
                                "supporting_ids": [f"doc{i}"]}) + "\n")
    return path


def test_search_metrics_by_hand():
    exs = [Example(prompt="q", answer="Paris", id="a", meta={"golden_answers": ["Paris"], "data_source": "x",
                                                             "supporting_ids": ["p1", "p2"]}),
           Example(prompt="q", answer="Rome", id="b", meta={"golden_answers": ["Rome"], "data_source": "y"})]
    rows = [{"id": "a", "responses": ["<answer> the Paris </answer>", "<answer>Paris, France</answer>"],
             "info": [{"searches": 2, "retrieved": ["p1", "p9"]}, {"searches": 0, "retrieved": []}]},
            {"id": "b", "responses": ["no answer <information><answer>Rome</answer></information>"],
             "info": [{"searches": 1, "retrieved": ["p2"]}]}]
    m = search_metrics(rows, exs)
    assert m["em"] == pytest.approx(1 / 3) and m["x/em"] == 0.5 and m["y/em"] == 0.0
    assert m["x/f1"] == pytest.approx((1 + 2 * 0.5 / 1.5) / 2)  # "paris france" vs "paris": P=1/2, R=1
    assert m["answered_rate"] == pytest.approx(2 / 3)  # an answer inside <information> is not the policy's
    assert m["searches"] == 1.0 and m["x/gold_recall"] == pytest.approx(0.25) and "y/gold_recall" not in m


def test_eval_search_agent_bm25_and_http(tiny_model_dir, tmp_path, server, capsys):  # noqa: F811
    qa = _qa(tmp_path / "qa.jsonl")
    common = ["eval", "--model", str(tiny_model_dir), "--agent", "search", "--benchmarks", str(qa), "--greedy",
              "--max-new-tokens", "12", "--max-searches", "2", "--max-context", "600", "--no-progress"]
    corpus = synthetic_corpus(tmp_path / "corpus.jsonl", n=20)
    assert main(common + ["--corpus", str(corpus), "--out", str(tmp_path / "bm25")]) == 0
    res = json.loads((tmp_path / "bm25" / "results.json").read_text())
    m = res["benchmarks"]["qa"]["metrics"]
    for k in ("search/em", "search/f1", "search/answered_rate", "search/searches", "search/gold_recall",
              "search/even/em", "search/odd/f1"):
        assert k in m, k
    rows = [json.loads(x) for x in (tmp_path / "bm25" / "qa.jsonl").read_text().splitlines()]
    assert all(len(r["info"]) == 1 and "retrieved" in r["info"][0] for r in rows)
    assert res["settings"]["search"]["retriever"] == "bm25"
    out = capsys.readouterr().out
    assert "gold_recall" in out and "  even" in out
    # the same through a real retrieval server
    assert main(common + ["--retriever", "http", "--url", server["url"], "--out", str(tmp_path / "http")]) == 0
    res2 = json.loads((tmp_path / "http" / "results.json").read_text())
    assert res2["settings"]["search"]["url"] == server["url"] and "search/em" in res2["benchmarks"]["qa"]["metrics"]
    # errors, before any model loads
    assert main(common + ["--retriever", "http"]) == 2
    assert main(common + ["--url", "http://127.0.0.1:1"]) == 2
    assert "needs --retriever http" in capsys.readouterr().err


def test_eval_search_named_benchmarks_load(tmp_path):
    d = shared_search_dir()
    if d is None:
        pytest.skip("the shared search data is not beside the checkout")
    from tether.search.data import load_search_examples

    for name in ("multihop_dev", "nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"):
        ex = load_search_examples(name, data_dir=d, limit=3)
        assert len(ex) == 3 and ex[0].meta["golden_answers"] and "<search>" in ex[0].prompt, name


def test_search_table_counts_unknown_gold_recall():
    from tether.eval.agents import format_search_table

    m = {"search/em": 0.5, "search/f1": 0.5, "search/answered_rate": 1.0, "search/searches": 1.5,
         "search/gold_recall": 0.25, "search/gold_recall_unknown": 3.0, "search/s/em": 0.5,
         "search/s/gold_recall_unknown": 3.0, "search/t/em": 1.0}
    lines = format_search_table({"qa": m}).splitlines()
    assert [ln.split()[-1] for ln in lines] == ["gold_recall_unknown", "3", "3", "0"]  # a count, 0 where none
    assert lines[1].split()[1:] == ["50.0", "50.0", "100.0", "1.50", "25.0", "3"] and lines[3].split()[0] == "t"
    assert len({len(ln) for ln in lines}) == 1  # aligned
    plain = format_search_table({"qa": {k: v for k, v in m.items() if "unknown" not in k}})
    assert "unknown" not in plain and plain.splitlines()[0].split()[-1] == "gold_recall"
