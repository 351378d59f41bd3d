"""Corpus loading (validation by file and line) and the search QA datasets."""

from __future__ import annotations

import json
import os

import pytest

from helpers import SEARCH_ENV
from search_helpers import SEARCH_DIR, needs_data
from search_helpers import write_jsonl as _write
from tether.search.corpus import CorpusError, load_corpus
from tether.search.data import SEARCH_DATASETS, load_search_examples, search_data_dir
from tether.tasks.base import DataError

GOOD = json.dumps({"id": "0", "contents": '"Title A"\ntext a'})


@pytest.mark.parametrize("bad, message", [
    ("{not json", "invalid JSON"),
    (json.dumps({"contents": '"T"\nx'}), "missing field 'id'"),
    (json.dumps({"id": "9"}), "missing field 'contents'"),
    (json.dumps({"id": ["1"], "contents": "x"}), "field 'id' must be a string or an integer"),
    (json.dumps({"id": "9", "contents": 5}), "field 'contents' must be a string"),
    (json.dumps(["id", "contents"]), "expected a JSON object"),
    (json.dumps({"id": "0", "contents": "dup"}), "duplicate id '0'"),
    (b'{"id": "9", "contents": "caf\xe9"}\n', "not valid UTF-8"),
])
def test_corpus_bad_row_names_file_and_line(tmp_path, bad, message):
    # line 2 is blank: line numbers are file lines, blank ones included
    f = _write(tmp_path / "c.jsonl", [GOOD, "", bad, json.dumps({"id": "5", "contents": "later"})])
    with pytest.raises(CorpusError) as e:
        load_corpus(f)
    assert f"{f} line 3" in str(e.value) and message in str(e.value)
    assert isinstance(e.value, DataError)  # the CLI reports DataError as a clean error


def test_corpus_ok_formats_and_empty(tmp_path):
    f = _write(tmp_path / "c.jsonl", [GOOD, json.dumps({"id": 7, "contents": "Plain\nbody"}),
                                      json.dumps({"id": "x", "title": "DPR style", "text": "body text"})])
    c = load_corpus(f)
    assert c.ids == ["0", "7", "x"] and c.titles == ["Title A", "Plain", "DPR style"]
    assert c.texts == ["text a", "body", "body text"] and len(c.sha256) == 64
    assert c.passage(2, 1.5).score == 1.5 and c.index_of("7") == 1
    with pytest.raises(CorpusError, match="empty"):
        load_corpus(_write(tmp_path / "e.jsonl", ["", ""]))
    with pytest.raises(CorpusError, match="not found"):
        load_corpus(tmp_path / "missing.jsonl")


@needs_data
def test_shared_corpora_load():
    c = load_corpus(SEARCH_DIR / "corpus.jsonl")
    assert len(c) == 12184 and c.titles[0] == "Jeff Porcaro"
    w = load_corpus(SEARCH_DIR / "wiki18_sample.jsonl")  # the Wikipedia-2018 format
    assert len(w) == 1000 and w.titles[0] == "Evan Morris" and all(w.titles)


@needs_data
def test_named_search_datasets():
    dev = load_search_examples("multihop_dev", data_dir=SEARCH_DIR)
    assert len(dev) == 564 and len(load_search_examples("multihop", data_dir=SEARCH_DIR)) == 700
    ex = dev[0]
    assert ex.id == "multihop_dev_dev:0" and ex.answer == "Rush"
    assert ex.meta["golden_answers"] == ["Rush"] and ex.meta["supporting_ids"] == ["4", "6"]
    assert ex.meta["data_source"] == "hotpotqa" and ex.meta["question"].startswith("Which Canadian rock band")
    assert ex.prompt.endswith(f"Question: {ex.meta['question']}\n") and "<search>" in ex.prompt
    assert {e.meta["data_source"] for e in dev} == {"hotpotqa", "musique", "2wikimultihopqa"}
    rows = {"nq": 3610, "triviaqa": 1000, "popqa": 1000, "hotpotqa": 7405, "2wikimultihopqa": 12576,
            "musique": 2417, "bamboogle": 125}
    assert set(rows) | {"multihop", "multihop_dev"} == set(SEARCH_DATASETS)
    for name, n in rows.items():
        exs = load_search_examples(name, data_dir=SEARCH_DIR, instruction=None)
        assert len(exs) == n, name
        assert exs[0].meta["data_source"] == name and exs[0].meta["supporting_ids"] == []
        assert exs[0].prompt == exs[0].meta["question"]
    tq = load_search_examples("triviaqa", data_dir=SEARCH_DIR, limit=1)[0]
    assert "Mark Twain" in tq.meta["golden_answers"] and tq.meta["answers"] == tq.meta["golden_answers"]


@needs_data
def test_search_data_dir_from_tether_data_dir(monkeypatch, tmp_path):
    (tmp_path / "math").mkdir()
    monkeypatch.delenv("TETHER_SEARCH_DATA_DIR", raising=False)
    monkeypatch.setenv("TETHER_DATA_DIR", str(tmp_path / "math"))
    assert search_data_dir() is None
    with pytest.raises(DataError, match="multihop_train.jsonl not found"):
        load_search_examples("multihop")
    os.symlink(SEARCH_DIR, tmp_path / "search")
    assert search_data_dir() == tmp_path / "search"
    assert len(load_search_examples("multihop_dev", limit=3)) == 3


def test_search_jsonl_field_mapping_and_bad_rows(tmp_path):
    f = _write(tmp_path / "qa.jsonl", [json.dumps({"q": "Who?", "gold": ["Ann", "Anne"], "k": 1}),
                                       json.dumps({"q": "When?", "gold": "1999"})])
    exs = load_search_examples(f, question_key="q", answers_key="gold", instruction=None)
    assert [e.answer for e in exs] == ["Ann", "1999"] and exs[0].meta["golden_answers"] == ["Ann", "Anne"]
    assert exs[0].id == "qa:0" and exs[0].meta["k"] == 1 and exs[0].meta["data_source"] == "qa"
    for bad, msg in [({"question": "Q"}, "missing field 'golden_answers'"),
                     ({"question": "", "golden_answers": ["a"]}, "'question' is empty"),
                     ({"question": "Q", "golden_answers": []}, "non-empty list"),
                     ({"question": "Q", "golden_answers": [["a"]]}, "item 0 must be a string"),
                     ({"question": "Q", "golden_answers": ["a"], "supporting_ids": "4"}, "supporting_ids")]:
        g = _write(tmp_path / "bad.jsonl", [json.dumps({"question": "ok", "golden_answers": ["x"]}), json.dumps(bad)])
        with pytest.raises(DataError) as e:
            load_search_examples(g)
        assert f"{g} line 2" in str(e.value) and msg in str(e.value)
    with pytest.raises(DataError, match="unknown search dataset"):
        load_search_examples("no_such_set")


def test_search_training_on_a_hub_id_reads_data_split(monkeypatch, tmp_path):
    """The search environment with a hub id trains on its ``data.split`` (default train, never the test split
    silently); a named set or a file is one split already and data.data_dir is the math task's: both are errors.
    ``datasets`` (the optional extra [hub], not a test dependency) is replaced by a stand-in module, so the test
    needs neither the package nor the hub."""
    import sys
    import types

    from tether.config import ConfigError
    from tether.resolve import load_config
    from tether.search.task import search_qa_task

    asked = []

    def load_dataset(hub_id, config, split):
        asked.append((hub_id, config, split))
        return [{"question": "Who?", "golden_answers": ["Ann"]}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    for over, split in [({}, "train"), ({"data.split": "validation"}, "validation")]:
        cfg = load_config(None, {**SEARCH_ENV, "data.task": "org/qa", **over})
        (ex,) = search_qa_task(cfg.data, cfg.rollout.agent.env)
        assert asked.pop() == ("org/qa", None, split) and ex.answer == "Ann"
    f = _write(tmp_path / "qa.jsonl", [json.dumps({"question": "Q", "golden_answers": ["a"]})])
    for task in ("multihop", str(f)):
        with pytest.raises(ConfigError, match=f"data.split only applies to a hub dataset id.*data.task='{task}' is "
                                              "one split already"):
            load_config(None, {**SEARCH_ENV, "data.task": task, "data.split": "test"})
    with pytest.raises(ConfigError, match=r"data.data_dir has no effect with rollout.agent.env.name=search \(its QA "
                                          r"sets are read from rollout.agent.env.retriever.data_dir\)"):
        load_config(None, {**SEARCH_ENV, "data.task": "multihop", "data.data_dir": str(tmp_path)})
