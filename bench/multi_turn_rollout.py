"""Rollout seconds of the multi-turn search agent with each token encoded once (``reuse_kv``) against
re-encoding the whole context every turn, on the same episodes.

Both sides run the same search agent (``SearchAgent``: the search environment, BM25 over the shared corpus)
on the same questions with the same seed, alternating (one warm-up rollout each, then ``--rounds`` timed
rollouts each); with the same seed they sample the same episodes unless float rounding flips a near-tie
(the bench prints whether the token counts agree). Prints per side the median rollout seconds and the
seconds spent in prefill (``generate``'s pre-fill of each call: the whole context without reuse, only the
new tokens with it) and in decoding, then the ratio reuse / re-encode.

Usage::

    python bench/multi_turn_rollout.py                          # SmolLM2, 2 questions x 5 episodes, 64 tokens per turn
    python bench/multi_turn_rollout.py --model runs/coldstart/sft_search --questions 4
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import machine_info  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model or run directory (default: the embedded SmolLM2)")
    p.add_argument("--questions", type=int, default=2, help="multihop train questions per rollout (default 2)")
    p.add_argument("--n", type=int, default=5, help="episodes per question (default 5)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="cap of each policy turn (default 64)")
    p.add_argument("--max-searches", type=int, default=4, help="search budget (default 4)")
    p.add_argument("--rounds", type=int, default=2, help="timed rollouts per side, after one warm-up (default 2)")
    p.add_argument("--seed", type=int, default=123, help="sampling seed (default 123)")
    return p.parse_args(argv)


class PrefillClock:
    """Seconds inside transformers' ``_prefill`` (the encoding part of each generate call)."""

    def __init__(self):
        from transformers.generation import utils

        self.seconds, self.utils, self.orig = 0.0, utils, utils.GenerationMixin._prefill
        clock = self

        def timed(model, *a, **k):
            t0 = time.perf_counter()
            try:
                return clock.orig(model, *a, **k)
            finally:
                clock.seconds += time.perf_counter() - t0

        utils.GenerationMixin._prefill = timed


def main(argv=None) -> int:
    a = parse_args(argv)
    print(machine_info())
    from tether.agents.search import SearchAgent
    from tether.config import ModelConfig, RolloutConfig
    from tether.models import load_model
    from tether.rollout import SamplingParams, make_engine
    from tether.search.data import corpus_path, load_search_examples
    from tether.search.retrievers import make_retriever

    model, tok = load_model(ModelConfig(name=a.model))
    retriever = make_retriever("bm25", corpus=str(corpus_path()))
    exs = load_search_examples("multihop", max_searches=a.max_searches, limit=a.questions)
    clock = PrefillClock()
    sides = {}
    for reuse in (False, True):
        eng = make_engine(RolloutConfig(engine="hf", batch_size=64, reuse_kv=reuse), model, tok)
        sides["reuse" if reuse else "reencode"] = SearchAgent(eng, tok, retriever, max_searches=a.max_searches,
                                                              max_context=2048, reuse_kv=reuse)
    sp = SamplingParams(n=a.n, temperature=0.7, max_new_tokens=a.max_new_tokens, seed=a.seed)
    rows = {k: [] for k in sides}
    for r in range(a.rounds + 1):
        for name, agent in sides.items():
            clock.seconds = 0.0
            t0 = time.perf_counter()
            rb = agent.rollout(exs, sp)
            total = time.perf_counter() - t0
            m = agent.metrics()
            print(f"[multi_turn_rollout] {name} round {r}{' (warm-up)' if r == 0 else ''}: {total:.1f} s, prefill "
                  f"{clock.seconds:.1f} s, {rb.gen_tokens} policy tokens, {int(rb.response_mask.sum())} in all, "
                  f"{m['search/searches']:.2f} searches/episode", flush=True)
            if r:
                rows[name].append((total, clock.seconds, rb.gen_tokens, int(rb.response_mask.sum())))
    print(f"\n{a.questions} questions x {a.n} episodes, {a.max_new_tokens} tokens per turn, median of {a.rounds}")
    print(f"{'side':10s} {'rollout s':>10s} {'prefill s':>10s} {'decode s':>9s} {'policy tok':>11s} {'all tok':>8s}")
    med = {}
    for name, rs in rows.items():
        t, p = statistics.median(x[0] for x in rs), statistics.median(x[1] for x in rs)
        med[name] = t
        print(f"{name:10s} {t:10.1f} {p:10.1f} {t - p:9.1f} {rs[-1][2]:11d} {rs[-1][3]:8d}")
    same = [x[2:] for x in rows["reuse"]] == [x[2:] for x in rows["reencode"]]
    print(f"same episodes (token counts equal in every round): {same}")
    print(f"ratio rollout time reuse/reencode = {med['reuse'] / med['reencode']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
