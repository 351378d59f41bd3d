"""The model organism (tether.organism, docs/organism.md): its problems, tokenizer, SFT rows, build and cache,
its task and its calculator environment. A mini spec (a few SFT steps of a one-layer model) stands in for the
default build, which takes minutes; the learning regression test on the real organism is in the slow set."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import subprocess_env
from tether.organism import build as organism_build
from tether.organism.build import OrganismSpec, build_organism, char_tokenizer, organism_path, sft_rows
from tether.tasks.organism_problems import (
    CALC,
    MAX_DIFFICULTY,
    MAX_VALUE,
    QUESTION,
    RL_DIFFICULTY,
    content_split,
    draw,
    response_tokens,
    solution_text,
    solve,
)

MINI = OrganismSpec(hidden_size=16, layers=1, heads=2, steps=3, choice_steps=2, batch_size=32, context=96)


def test_the_calculator_environment_poses_the_organism_prompt():
    from tether.envs import make_env
    from tether.tasks.organism import OrganismTask

    ex = OrganismTask(difficulty=2).example(0)
    assert ex.prompt.startswith(QUESTION)
    assert make_env("organism_calc").start(ex).prompt == CALC + ex.prompt[len(QUESTION):]


def test_problems_are_pure_in_range_and_split_by_content():
    seen = {"train": set(), "test": set()}
    for split in ("train", "test"):
        for i in range(300):
            start, ops = draw(split, 0, 3, i)
            assert draw(split, 0, 3, i) == (start, ops)
            assert all(0 <= v <= MAX_VALUE for v in solve(start, ops))
            assert content_split(start, ops) == split
            seen[split].add((start, tuple(ops)))
    assert not seen["train"] & seen["test"]
    assert solution_text(47, [("+", 38), ("-", 12)]) == "47+38=85\n85-12=73\n#### 73"


def test_char_tokenizer_round_trips_and_is_one_token_a_character():
    tok = char_tokenizer()
    text = "Q:47+38-12\n47+38=85\n#### 85 <calc>1*2</calc><result>2</result>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "Q:1+2"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nQ:1+2<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<pad>" and tok.padding_side == "left"


def test_sft_rows_are_deterministic_verified_and_mix_both_prompts():
    spec = OrganismSpec(steps=40, batch_size=50)
    rows = sft_rows(spec)
    assert rows == sft_rows(spec) and len(rows) == 2000
    plain = [r for r in rows if "prompt" in r]
    calls = [r for r in rows if "messages" in r]
    assert {r["prompt"][:2] for r in plain} == {QUESTION, CALC}
    assert 0.02 < len(calls) / len(rows) < 0.08  # calc_share 0.2 x call_share 0.2
    for r in plain[:200]:  # each worked solution is right: its lines recompute to the answer
        expr, lines = r["prompt"][2:], r["completion"].split("\n")
        assert str(eval(expr)) == lines[-1].removeprefix("#### ")  # noqa: S307 (digits and +- only)
    seg = calls[0]["messages"][1]["content"]
    assert [s["train"] for s in seg] == [True, False, True] and seg[1]["text"].startswith("<result>")
    direct = [r for r in plain if r["completion"].startswith("####")]
    assert not direct  # phase 1 teaches the skills: every plain row is worked
    choice = [r for r in sft_rows(OrganismSpec(choice_steps=20, batch_size=100), phase=2) if "prompt" in r]
    direct = [r for r in choice if r["completion"].startswith("####")]
    assert direct and all(r["prompt"].count("+") + r["prompt"].count("-") == 3 for r in direct)  # difficulty 3 only
    assert 0.5 < len(direct) / sum(r["prompt"].count("+") + r["prompt"].count("-") == 3 for r in choice) < 0.7


@pytest.fixture(scope="module")
def mini_organism(tmp_path_factory):
    """The MINI organism, built once for this module (a build takes ~15 s) in a cache directory of its own."""
    return build_organism(MINI, cache_dir=tmp_path_factory.mktemp("organism"), log=lambda m: None)


def _no_rebuild(*args, **kwargs):
    raise AssertionError("the cached organism was built again")


def test_build_is_deterministic_and_cached(mini_organism, tmp_path, monkeypatch):
    a = mini_organism
    b = build_organism(MINI, cache_dir=tmp_path / "b", log=lambda m: None)  # a second build, from nothing
    assert a.name == b.name == f"organism-{MINI.key()}"
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    meta = json.loads((a / "organism.json").read_text())
    assert meta["key"] == MINI.key() and meta["spec"]["steps"] == MINI.steps
    monkeypatch.setattr(organism_build, "_build", _no_rebuild)
    assert build_organism(MINI, cache_dir=a.parent) == a  # the second build reuses the cache
    assert OrganismSpec(steps=4).key() != OrganismSpec().key()  # another spec, another directory


def test_model_name_organism_resolves_to_the_build(mini_organism, monkeypatch):
    """model.name=organism is the default spec's build in the cache (here MINI's, already built: not again)."""
    from tether.models import resolve_model_path

    monkeypatch.setattr(organism_build, "DEFAULT_SPEC", MINI)
    monkeypatch.setattr(organism_build, "_build", _no_rebuild)
    path = resolve_model_path("organism", cache_dir=mini_organism.parent)
    assert path == str(organism_path(MINI, mini_organism.parent)) == str(mini_organism)
    assert os.path.isfile(os.path.join(path, "organism.json"))


def test_a_failed_build_says_which_step_and_leaves_nothing(tmp_path):
    bad = OrganismSpec(hidden_size=16, layers=1, heads=2, steps=3, choice_steps=0, batch_size=4, lr=-1.0)
    with pytest.raises(Exception, match="building the organism: `tether sft` failed"):
        build_organism(bad, cache_dir=tmp_path, log=lambda m: None)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


@pytest.mark.parametrize("agent", ["single_turn", "multi_turn"])
def test_train_and_eval_run_on_the_organism_task(mini_organism, tmp_path, agent):
    """`tether train --task organism` (single-turn, and in the organism_calc environment) and `tether eval`
    on its benchmark, through the CLI."""
    extra = ["rollout.agent=multi_turn", "rollout.agent.env.name=organism_calc"] if agent == "multi_turn" else []
    cmd = [sys.executable, "-m", "tether", "train", "--task", "organism", f"model.name={mini_organism}",
           "train.steps=2", "rollout.prompts_per_step=2", "rollout.n=2", "eval.limit=4", "eval.every=0",
           "rollout.max_new_tokens=12", "eval.max_new_tokens=12", "run.progress=false", "run.plot=false",
           f"run.output_dir={tmp_path / 'run'}", *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "held-out accuracy, before -> after training: organism (4 problems" in p.stderr + p.stdout
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and "eval/organism/avg@1" in rows[0] and rows[-1]["step"] == 2
    if agent == "multi_turn":
        assert "<result>" in (tmp_path / "run" / "samples.jsonl").read_text()  # the environment answered
    ev = subprocess.run([sys.executable, "-m", "tether", "eval", "--model", str(mini_organism), "--benchmarks",
                         "organism-d2", "--limit", "3", "--max-new-tokens", "8"],
                        capture_output=True, text=True, env=subprocess_env(), timeout=600, cwd=tmp_path)
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert "organism_d2" in ev.stdout + ev.stderr


def test_a_response_cap_holds_every_worked_solution_of_its_difficulty():
    """`response_tokens(d)` is at least the longest worked solution of difficulty d and its end token (one token a
    character), and is the organism regime's rollout and evaluation length at the RL difficulty."""
    from tether.tasks.registry import ORGANISM_PRESET

    for d in range(1, MAX_DIFFICULTY + 1):
        longest = max(len(solution_text(*draw(split, 0, d, i))) + 1 for split in ("train", "test") for i in range(400))
        assert longest <= response_tokens(d) < longest + 16 + 4, d
    assert ORGANISM_PRESET["rollout.max_new_tokens"] == ORGANISM_PRESET["eval.max_new_tokens"] == 48 \
        == response_tokens(RL_DIFFICULTY)


def test_eval_answers_an_organism_benchmark_within_its_own_cap(mini_organism, tmp_path, capsys):
    """`tether eval --model organism --benchmarks organism` needs no --max-new-tokens: eval's 512-token default
    does not fit the organism's context, so each organism-dN benchmark is answered within its own cap
    (`response_tokens`), recorded per benchmark in results.json; --max-new-tokens, given, still applies to every
    benchmark."""
    from tether.cli import main

    assert main(["eval", "--model", str(mini_organism), "--benchmarks", "organism-d2", "organism", "--limit", "2",
                 "--greedy", "--no-progress", "--out", str(tmp_path / "own")]) == 0
    report = json.loads((tmp_path / "own" / "results.json").read_text())
    assert {k: v["max_new_tokens"] for k, v in report["benchmarks"].items()} == {"organism_d2": 32, "organism_d3": 48}
    assert "max_new_tokens=organism_d2: 32, organism_d3: 48;" in capsys.readouterr().out
    assert main(["eval", "--model", str(mini_organism), "--benchmarks", "organism-d2", "organism", "--limit", "2",
                 "--greedy", "--no-progress", "--max-new-tokens", "8", "--out", str(tmp_path / "given")]) == 0
    report = json.loads((tmp_path / "given" / "results.json").read_text())
    assert {v["max_new_tokens"] for v in report["benchmarks"].values()} == {8}
    assert "max_new_tokens=8;" in capsys.readouterr().out


@pytest.mark.parametrize("spec,runs", [("organism_default.yaml", "1 arm(s) x 10 seed(s) = 10 run(s)"),
                                       ("evidence_anchors.yaml", "18 arm(s) x 10 seed(s) = 180 run(s)")])
def test_the_organism_sweep_specs_resolve(spec, runs, capsys):
    """Every arm of the committed organism sweeps resolves (tether sweep --dry-run checks each with load_config)."""
    from pathlib import Path

    from tether.cli import main

    assert main(["sweep", str(Path(__file__).resolve().parents[1] / "configs" / "sweeps" / spec), "--dry-run"]) == 0
    assert runs in capsys.readouterr().out
