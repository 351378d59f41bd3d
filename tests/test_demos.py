"""Cold-start demonstrations (tether.sft.demos): teacher trajectories through the real environments, rows in the
SFT format with observations untrained, built from training splits only (no dev, test or benchmark question)."""

from __future__ import annotations

import json
import random

import pytest

from search_helpers import SEARCH_DIR, needs_data, write_jsonl
from tether.envs import CalculatorEnv, SearchEnv
from tether.envs.calculator import evaluate
from tether.search.protocol import render_observation
from tether.sft.demos import DemoStats, arithmetic_expression, calculator_demos, gsm8k_turns, search_demos
from tether.tasks import Example
from tether.tasks.arithmetic import ArithmeticTask, apply_ops


def assistant(row) -> list[dict]:
    return row["messages"][-1]["content"]


def test_arithmetic_demos_write_the_exact_expression_and_the_answer():
    for d in (1, 2, 3, 4):
        task = ArithmeticTask(seed=3, difficulty=d)
        for i in range(50):
            ex = task.example(i)
            expr = arithmetic_expression(ex.meta["start"], ex.meta["ops"])
            assert evaluate(expr) == apply_ops(ex.meta["start"], ex.meta["ops"]) == int(ex.answer), expr
    exs = [ArithmeticTask(seed=1, difficulty=3).example(i) for i in range(4)]
    stats = DemoStats()
    rows = list(calculator_demos(exs, CalculatorEnv(max_turns=4), stats))
    assert stats.written == 4 and not stats.skipped and len(rows) == 4
    for ex, row in zip(exs, rows):
        assert row["messages"][0] == {"role": "user", "content": CalculatorEnv().start(ex).prompt}
        segs = assistant(row)
        assert [s["train"] for s in segs] == [True, False, True]
        assert segs[0]["text"].endswith("</calc>") and segs[1]["text"] == f"<result>{ex.answer}</result>"
        assert segs[2]["text"] == f"\n#### {ex.answer}" and row["source"] == ex.id


GSM = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether.\n"
       "#### 72")


def test_gsm8k_annotations_become_calls():
    turns = gsm8k_turns(GSM)
    assert turns == [("Natalia sold 48/2 = <calc>48/2</calc>", "24"),
                     (" clips in May.\nNatalia sold 48+24 = <calc>48+24</calc>", "72"),
                     (" clips altogether.\n#### 72", "")]
    assert gsm8k_turns("no final answer") is None
    ex = Example("Natalia sold clips...", "72", "gsm8k_train:0", {"solution": GSM})
    [row] = calculator_demos([ex], CalculatorEnv(max_turns=3))
    segs = assistant(row)
    assert [s["train"] for s in segs] == [True, False, True, False, True]
    assert segs[1]["text"] == "<result>24</result>" and segs[3]["text"].startswith("<result>72</result>")
    text = "".join(s["text"] for s in segs)
    assert "<result>24</result> clips in May" in text and text.endswith("#### 72")
    stats = DemoStats()  # over the budget (1 call), and a value the calculator computes differently
    wrong = Example("q", "5", "w", {"solution": "It is 10/4 = <<10/4=3>>3.\n#### 3"})
    assert list(calculator_demos([ex, wrong], CalculatorEnv(max_turns=2), stats)) == []
    assert stats.skipped == {"with more than 1 calculations": 1,
                             "whose annotated value the calculator computes differently": 1}


class Retriever:
    def __init__(self, passages):
        self.passages = passages

    def search(self, queries, k):
        from tether.search.corpus import Passage

        out = []
        for q in queries:
            words = [w.strip("?.,").lower() for w in q.split() if len(w.strip("?.,")) > 3]
            hits = [Passage(pid, t, x, 1.0) for pid, t, x in self.passages if any(w in x.lower() for w in words)]
            out.append(hits[:k])
        return out


def test_search_demos_search_until_a_gold_answer_shows():
    from types import SimpleNamespace

    passages = [("1", "Ann Lee", "Ann Lee wrote the novel Riverbend."), ("2", "Riverbend", "Riverbend is a town.")]
    corpus = SimpleNamespace(titles=["Ann Lee", "Riverbend"], index_of={"1": 0, "2": 1}.__getitem__)
    ret = Retriever(passages)
    ex = Example("Who wrote Riverbend?", "Ann Lee", "q:0",
                 {"question": "Who wrote Riverbend?", "golden_answers": ["Ann Lee"], "supporting_ids": ["1"]})
    [row] = search_demos([ex], SearchEnv(ret, topk=2, max_searches=4), corpus)
    segs = assistant(row)
    assert [s["train"] for s in segs] == [True, False, True]
    assert "<search> Who wrote Riverbend? </search>" in segs[0]["text"]
    assert segs[1]["text"] == render_observation(ret.search(["Who wrote Riverbend?"], 2)[0])
    assert segs[2]["text"].endswith("<answer> Ann Lee </answer>")
    # the question alone finds nothing that holds the answer: a second search for the gold paragraph's title
    ex2 = Example("Which place?", "a town", "q:1", {"question": "Which place?", "golden_answers": ["a town"],
                                                   "supporting_ids": ["2"]})
    [row] = search_demos([ex2], SearchEnv(ret, topk=2, max_searches=4), corpus)
    assert [s["train"] for s in assistant(row)] == [True, False, True, False, True]
    assert "<search> Riverbend </search>" in assistant(row)[2]["text"]
    stats = DemoStats()
    ex3 = Example("Nothing?", "zebra", "q:2", {"question": "Nothing?", "golden_answers": ["zebra"],
                                              "supporting_ids": ["9"]})
    assert list(search_demos([ex3], SearchEnv(ret, topk=2), corpus, stats)) == []
    assert stats.skipped == {"whose searches never showed a gold answer": 1}


def _questions(path) -> set[str]:
    return {json.loads(line)["question"].strip() for line in open(path) if line.strip()}


@needs_data
def test_search_demos_use_the_train_split_only(tmp_path):
    """Demonstrations from the multihop train split (the real BM25 over the shared corpus) hold no question of the
    dev split or of any of the 7 QA benchmarks."""
    from tether.search.corpus import load_corpus
    from tether.search.data import load_search_examples
    from tether.search.retrievers import make_retriever

    exs = load_search_examples("multihop", data_dir=SEARCH_DIR)
    assert {e.meta["split"] for e in exs} == {"train"}
    corpus = load_corpus(SEARCH_DIR / "corpus.jsonl")
    env = SearchEnv(make_retriever("bm25", corpus=str(SEARCH_DIR / "corpus.jsonl")), topk=3, max_searches=4)
    stats = DemoStats()
    rows = list(search_demos(exs, env, corpus, stats))
    assert stats.written == len(rows) >= 200
    held_out = _questions(SEARCH_DIR / "multihop_dev.jsonl")
    for f in sorted((SEARCH_DIR / "eval").glob("*.jsonl")):
        held_out |= _questions(f)
    assert len(held_out) > 1000
    shown = [r["messages"][-2]["content"] for r in rows]
    leaks = [q for q in held_out if any(q in s for s in shown)]
    assert not leaks, leaks[:3]


@needs_data
def test_calculator_demos_use_the_train_split_only():
    """GSM8K demonstrations come from its train split (no test question); arithmetic ones from the task's train
    split, whose problems never share content with its test split."""
    from pathlib import Path

    from tether.tasks.data import load_examples

    math_dir = Path(SEARCH_DIR).parent / "math"
    train = load_examples("gsm8k", split="train", data_dir=str(math_dir))
    rows = list(calculator_demos(random.Random(0).sample(train, 300), CalculatorEnv(max_turns=4)))
    test = {json.loads(line)["question"].strip() for line in open(math_dir / "gsm8k_test.jsonl")}
    assert rows and not [r for r in rows if any(r["messages"][0]["content"].endswith(q) for q in test)]
    task = ArithmeticTask(seed=0, difficulty=3)
    test_prompts = {task.with_split("test").example(i).prompt for i in range(500)}
    arith = list(calculator_demos([task.example(i) for i in range(500)], CalculatorEnv()))
    assert len(arith) == 500 and not [r for r in arith if any(r["messages"][0]["content"].endswith(p)
                                                               for p in test_prompts)]


def test_rows_round_trip_as_jsonl(tmp_path):
    exs = [ArithmeticTask(seed=0, difficulty=2).example(i) for i in range(3)]
    path = write_jsonl(tmp_path / "demos.jsonl", list(calculator_demos(exs, CalculatorEnv())))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 3 and all(r["messages"][-1]["role"] == "assistant" for r in rows)


@pytest.mark.parametrize("max_turns", [2, 4])
def test_the_prompt_states_the_budget_the_demo_used(max_turns):
    ex = ArithmeticTask(seed=0, difficulty=1).example(0)
    [row] = calculator_demos([ex], CalculatorEnv(max_turns=max_turns))
    assert f"up to {max_turns - 1} times" in row["messages"][0]["content"]


@pytest.mark.slow  # about 13 s: out of the default suite's 15 minutes, run by CI's slow step
def test_tether_demos_command(tmp_path):
    """tether demos in a subprocess: the rows file and a summary; an existing file, an evaluation set and a bad
    difficulty are one-line errors."""
    from helpers import assert_clean_error, run_module

    out = tmp_path / "d.jsonl"
    r = run_module("demos", "calculator", "--out", str(out), "--limit", "3", "--difficulty", "2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(out) and "3 demonstrations" in r.stderr
    assert len(out.read_text().splitlines()) == 3
    for args, needle in ((["calculator", "--out", out, "--limit", "3"], f"{out} exists"),
                         (["calculator", "--out", tmp_path / "x", "--data", "math500"], "is an evaluation set"),
                         (["search", "--out", tmp_path / "x", "--data", "multihop_dev"], "is an evaluation set"),
                         (["calculator", "--out", tmp_path / "x", "--difficulty", "7"], "--difficulty must be 1")):
        r = run_module("demos", *args)
        assert_clean_error(r.returncode, r.stderr, needle)


def test_demo_edges():
    turns = gsm8k_turns("He pays 10*2 = <<10*2=20>>200 cents.\n#### 200")  # 200 is not the 20 shown again
    assert turns[0] == ("He pays 10*2 = <calc>10*2</calc>", "20") and turns[1][0].startswith("200 cents")


def test_tether_demos_refuses_a_directory_and_an_empty_result(tmp_path):
    from helpers import assert_clean_error, run_module

    r = run_module("demos", "calculator", "--out", tmp_path, "--limit", "2")
    assert_clean_error(r.returncode, r.stderr, "is a directory")
    data = tmp_path / "nosolution.jsonl"
    data.write_text(json.dumps({"question": "1 + 1?", "answer": "2"}) + "\n")
    r = run_module("demos", "calculator", "--data", data, "--out", tmp_path / "out.jsonl")
    assert_clean_error(r.returncode, r.stderr, "no demonstration could be built")
    assert not (tmp_path / "out.jsonl").exists()


def test_demos_and_training_build_one_environment():
    """`tether demos` builds its environment with tether.agents.build.build_env from the keys training sets, so a
    demonstration's observations are the ones training shows; an agent without an environment is refused."""
    from tether.agents.build import build_env
    from tether.config import ConfigError
    from tether.envs.calculator import CalculatorEnv
    from tether.resolve import load_config

    env = build_env(load_config(None, {"rollout.agent": "multi_turn", "rollout.agent.env.max_turns": 3}))
    assert isinstance(env, CalculatorEnv) and env.max_turns == 3
    with pytest.raises(ConfigError, match="rollout.agent.kind=single_turn runs no environment"):
        build_env(load_config(None, {}))
