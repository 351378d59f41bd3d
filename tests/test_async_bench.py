"""bench/async_model.py's speed-up model (exact on constant times, the tail absorbed by a larger K) and
bench/async.py end to end on the tiny model (synchronous against K = 1, its table and ratios)."""

from __future__ import annotations

import re

import pytest


@pytest.fixture(scope="module")
def model(bench_script):
    return bench_script("async_model")


def test_constant_times_pipeline_to_max_of_generation_and_update(model):
    assert model.simulate([3.0], [1.0], 0) == pytest.approx(4.0)
    assert model.simulate([3.0], [1.0], 1, steps=1000) == pytest.approx(3.0, rel=1e-2)  # max(G, U)
    assert model.simulate([1.0], [3.0], 4, steps=1000) == pytest.approx(3.0, rel=1e-2)
    assert model.simulate([4.0], [1.0], 2, workers=2, steps=1000) == pytest.approx(2.0, rel=1e-2)  # G / W
    assert model.simulate([4.0], [1.0], 1, workers=2, steps=1000) == pytest.approx(2.5, rel=1e-2)  # (G + U) / L
    assert model.speedup([2.0], [2.0], 1) == pytest.approx(2.0, rel=1e-2)  # the overlap's bound


def test_a_long_tail_is_absorbed_by_a_larger_k(model):
    gen, upd = [1.0] * 9 + [10.0], [3.0]  # mean 1.9 < U: with room in the queue the tail is hidden
    k1, k4 = model.simulate(gen, upd, 1, steps=4000), model.simulate(gen, upd, 4, steps=4000)
    assert k4 < k1 and k4 == pytest.approx(3.0, rel=0.05)
    assert k1 == pytest.approx(0.9 * 3.0 + 0.1 * 10.0, rel=0.1)  # K = 1 pays about E[max(G, U)]


def test_split_devices(model):
    assert model.split_speedup(0.8, tail=1.0)[0] == pytest.approx(1.0)  # linear scaling, no tail: nothing
    s, share = model.split_speedup(0.8, tail=4.0)
    assert s == pytest.approx(1 / (0.2 + 0.2)) and share == pytest.approx(0.5)
    assert "impossible" in "\n".join(model.paper_lines())


def test_bench_async_runs_end_to_end(bench_script, tiny_model_dir, capsys):
    mod = bench_script("async")
    assert mod.main(["--model", str(tiny_model_dir), "--steps", "2", "--warmup", "0", "--ks", "0,1",
                     "--prompts", "2", "--n", "2", "--max-new-tokens", "4", "--trainer-threads", "1",
                     "--worker-threads", "1", "--sync-threads", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^sync\s+[\d.]+\s+[\d.]+", out, re.M) and re.search(r"^K=1\s+[\d.]+", out, re.M)
    assert re.search(r"ratio step time sync/K=1 = \d+\.\d\d \(model: \d+\.\d\d", out)
    assert re.findall(r"^(?:sync|K=1)\s+(?:\S+\s+){4}(\d+)$", out, re.M) == ["16", "16"]  # the same samples
