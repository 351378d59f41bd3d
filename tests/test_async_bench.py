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


def test_bench_async_runs_every_k_with_each_worker_count(bench_script, capsys):
    """--workers 1,2 runs each K >= 1 with one and with two workers (the synchronous run once, with none);
    the labels tell them apart; a bad list is refused by name."""
    mod = bench_script("async")
    a = mod.parse_args(["--ks", "0,1,4", "--workers", "1,2", "--device", "cuda", "--dtype", "bfloat16"])
    assert a.runs == [(0, 0), (1, 1), (1, 2), (4, 1), (4, 2)]
    assert [mod.label(k, w, a) for k, w in a.runs] == ["sync", "K=1 W=1", "K=1 W=2", "K=4 W=1", "K=4 W=2"]
    assert mod.label(1, 1, mod.parse_args(["--ks", "0,1"])) == "K=1"  # one worker count: the label as before
    for bad in (["--workers", "0"], ["--workers", "one"], ["--ks", "-1"]):
        with pytest.raises(SystemExit):
            mod.parse_args(bad)
        assert "--workers" in capsys.readouterr().err


def test_random_weights_keep_the_shape_and_tokenizer(bench_script, tiny_model_dir, tmp_path):
    """--random-weights: the model's config and tokenizer, new weights, loadable by tether (what the bench times
    on a machine that has the config but not the weights)."""
    import torch

    from tether.models import ModelConfig, load_model

    out = bench_script("async").random_like(str(tiny_model_dir), "float32", tmp_path / "rand", seed=123)
    (m0, tok0), (m1, tok1) = (load_model(ModelConfig(name=str(d), dtype="float32")) for d in (tiny_model_dir, out))
    assert m0.config.to_dict() | {"_name_or_path": ""} == m1.config.to_dict() | {"_name_or_path": ""}
    assert tok0.get_vocab() == tok1.get_vocab() and tok0.chat_template == tok1.chat_template
    p0, p1 = dict(m0.named_parameters()), dict(m1.named_parameters())
    assert p0.keys() == p1.keys() and all(p0[k].shape == p1[k].shape for k in p0)
    assert not any(torch.equal(p0[k], p1[k]) for k in p0 if "norm" not in k)  # norms start at 1 in both
