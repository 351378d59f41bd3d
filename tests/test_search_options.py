"""The search options from the config and the eval command line to the agent and the retriever:
search.observation_format (and its did-you-mean), search.corpus with the http retriever (ids of
id-less documents), and tether eval's --timeout / --retries / --corpus / --observation-format,
against a tiny stdlib retrieval server that records its requests."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from search_helpers import synthetic_corpus
from test_search_agent import EX, FakeRetriever, ScriptedEngine, char_ids, segments
from tether.agents import env_from_config
from tether.agents.build import RolloutPlan
from tether.envs.search import SearchEnv
from tether.errors import ConfigError
from tether.resolve import load_config
from tether.rollout import SamplingParams
from tether.search.corpus import load_corpus
from tether.search.protocol import render_observation
from tether.search.retrievers import HTTPRetriever, RetrievalError


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _episode_observation(agent, tok, eng) -> str:
    """Run one scripted episode (a search, then an answer) and return its observation's text."""
    rb = agent.rollout([EX], SamplingParams(n=1, max_new_tokens=64))
    obs = [tok.decode(s) for p, s in segments(rb) if not p]
    assert len(obs) == 1 and len(eng.calls) == 2
    return obs[0]


def _script(tok):
    return ScriptedEngine(tok, [[char_ids(tok, "<search>first q</search>")], [char_ids(tok, "<answer>Ann</answer>")]])


@pytest.mark.parametrize("fmt", [None, "search_r1", "clean"])
def test_observation_format_reaches_the_agent(tok, fmt):
    over = {"rollout.agent.env.max_obs_tokens": 10_000,
            **({"rollout.agent.env.retriever.passage_format": fmt} if fmt else {})}
    cfg = load_config(None, over, task="search")
    env = cfg.rollout.agent.env
    assert env.retriever.passage_format == (fmt or "search_r1")
    eng = _script(tok)
    agent = RolloutPlan(cfg, tools={"env": env_from_config(env, FakeRetriever())}).agent(eng, tok)
    obs = _episode_observation(agent, tok, eng)
    passages = FakeRetriever().search(["first q"], env.retriever.topk)[0]
    assert obs == render_observation(passages, fmt or "search_r1")
    if fmt == "clean":
        assert "Doc 1(Title: T0 first q) text 0 about first q\nDoc 2(Title: T1 first q)" in obs
    else:  # the default: Search-R1's bytes, the title's quotes kept
        assert 'Doc 1(Title: "T0 first q") text 0 about first q\nDoc 2(Title: "T1 first q")' in obs


def test_observation_format_is_validated():
    with pytest.raises(ConfigError, match=r"unknown rollout.agent.env.retriever.passage_format 'search-r1'. Did "
                                          r"you mean 'search_r1'\? Valid choices: search_r1, clean"):
        load_config(None, {"rollout.agent.env.retriever.passage_format": "search-r1"}, task="search")
    with pytest.raises(ConfigError, match="rollout.agent.env.retriever is a key of rollout.agent.env.name=search, "
                                          "and rollout.agent.env.name is 'calculator'"):
        load_config(None, {"rollout.agent": "multi_turn", "rollout.agent.env.retriever.passage_format": "clean"})
    with pytest.raises(ValueError, match="unknown observation_format 'plain'"):
        SearchEnv(FakeRetriever(), observation_format="plain")


def test_search_corpus_goes_to_the_http_retriever(tmp_path):
    corpus = synthetic_corpus(tmp_path / "corpus.jsonl", n=5)
    base = {"rollout.agent.env.retriever.kind": "http", "rollout.agent.env.retriever.url": "http://127.0.0.1:1"}
    # no longer "only bm25 or dense"
    cfg = load_config(None, {**base, "rollout.agent.env.retriever.corpus": str(corpus)}, task="search")
    r = RolloutPlan(cfg).tools["env"].retriever
    assert isinstance(r, HTTPRetriever) and r.corpus is not None and len(r.corpus) == 5
    assert RolloutPlan(load_config(None, base, task="search")).tools["env"].retriever.corpus is None  # none by default
    with pytest.raises(ConfigError, match="rollout.agent.env.retriever.dense_model is a key of "
                                          "rollout.agent.env.retriever.kind=dense"):
        load_config(None, {**base, "rollout.agent.env.retriever.dense_model": "m"}, task="search")


# ---------------------------------------------------------------- a tiny retrieval server


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, corpus):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.corpus, self.requests, self.mode, self.release = corpus, [], "ok", threading.Event()


class _Handler(BaseHTTPRequestHandler):
    """POST /retrieve: Search-R1's BM25 server's answer (documents without ids), a 500, or no answer."""

    def do_POST(self):  # noqa: N802
        s = self.server
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        s.requests.append((self.path, body))
        if s.mode == "hang":
            s.release.wait(10)  # bounded: the test releases it
            return
        if s.mode == "500":
            self.send_error(500, "boom")
            return
        docs = [{"title": t, "text": x, "contents": c} for t, x, c in zip(s.corpus.titles, s.corpus.texts,
                                                                           s.corpus.contents)]
        data = json.dumps({"result": [[{"document": d, "score": 1.0} for d in docs[: body["topk"]]]
                                      for _ in body["queries"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub(tmp_path):
    corpus = synthetic_corpus(tmp_path / "corpus.jsonl", n=6)
    srv = _Server(load_corpus(corpus))
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv, f"http://127.0.0.1:{srv.server_address[1]}", corpus
    finally:
        srv.release.set()
        srv.shutdown()
        srv.server_close()
        t.join(10)


def _eval_args(tmp_path, *extra):
    from tether.cli import build_parser

    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question": "Who?", "golden_answers": ["Ann"], "supporting_ids": ["p1"]}) + "\n")
    return build_parser().parse_args(["eval", "--model", "m", "--agent", "search", "--benchmarks", str(qa), *extra])


def test_eval_flags_reach_the_http_retriever(tmp_path, tok, stub):
    from tether.eval.agents import search_setup as _search_setup

    srv, url, corpus = stub
    args = _eval_args(tmp_path, "--retriever", "http", "--url", url, "--timeout", "7.5", "--retries", "0",
                      "--corpus", str(corpus), "--observation-format", "clean", "--topk", "2")
    _, plan = _search_setup(args)
    cfg, tools = plan.cfg, plan.tools
    r = tools["env"].retriever
    assert isinstance(r, HTTPRetriever) and (r.timeout, r.retries, len(r.corpus)) == (7.5, 0, 6)
    r_cfg = cfg.rollout.agent.env.retriever
    assert r_cfg.passage_format == "clean" and r_cfg.topk == 2
    # one episode through the agent: the server's id-less documents get their corpus ids back (gold recall)
    eng = _script(tok)
    cfg.rollout.agent.env.max_obs_tokens = 10_000
    agent = RolloutPlan(cfg, tools).agent(eng, tok)
    rb = agent.rollout([EX], SamplingParams(n=1, max_new_tokens=64))
    assert srv.requests == [("/retrieve", {"queries": ["first q"], "topk": 2, "return_scores": True})]
    assert rb.info[0]["retrieved"] == ["p0", "p1"]
    obs = [tok.decode(s) for p, s in segments(rb) if not p][0]
    assert obs.startswith("\n\n<information>Doc 1(Title: Entry 0) The ")  # clean: no quotes
    # --retries 1: a failing server is asked twice; --retries 0 and --timeout: one attempt that times out
    srv.mode = "500"
    _, plan = _search_setup(_eval_args(tmp_path, "--retriever", "http", "--url", url, "--retries", "1"))
    r1 = plan.tools["env"].retriever
    r1.backoff = 0.0
    with pytest.raises(RetrievalError, match="HTTP 500") as e:
        r1.search(["q"], 1)
    assert e.value.attempts == 2 and len(srv.requests) == 3
    srv.mode = "hang"
    r0 = _search_setup(_eval_args(tmp_path, "--retriever", "http", "--url", url, "--retries", "0",
                                  "--timeout", "0.2"))[1].tools["env"].retriever
    with pytest.raises(RetrievalError, match="timed out") as e:
        r0.search(["q"], 1)
    assert e.value.attempts == 1 and len(srv.requests) == 4


def test_eval_http_flags_need_the_http_retriever(tmp_path, capsys):
    from tether.cli import main

    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question": "Who?", "golden_answers": ["Ann"]}) + "\n")
    common = ["eval", "--model", "m", "--agent", "search", "--benchmarks", str(qa), "--out", str(tmp_path / "o")]
    assert main(common + ["--timeout", "5"]) == 2
    assert "--timeout needs --retriever http" in capsys.readouterr().err
    assert main(common + ["--retries", "0", "--url", "http://127.0.0.1:1"]) == 2
    assert "--url and --retries need --retriever http" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: not one of search_r1, clean
        main(common + ["--observation-format", "plain"])
    assert not (tmp_path / "o").exists()
