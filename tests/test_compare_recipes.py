"""bench/compare_recipes.py (the results report) in --quick mode on the tiny random model.

The script is driven through its ``main(argv)``, on the synthetic arithmetic task and on a small
GSM8K-like data directory (``gsm8k_train.jsonl`` / ``gsm8k_test.jsonl``) written here, so the
test needs no shared data. Checked: the report, the JSON and the plot are written with finite
numbers; the exact full-vocabulary KL matches a naive full-logits computation; a run whose
weights cannot move (lr = 0) has KL 0 to the initial model and the initial accuracy, while a
run that got a learning signal has KL > 0; a crashing run is recorded and the others go on.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def cr(bench_script):
    return bench_script("compare_recipes")


@pytest.fixture(scope="module")
def gsm_dir(tmp_path_factory):
    """GSM8K-shaped files: a question and a worked answer ending in '#### N'."""
    d = tmp_path_factory.mktemp("gsm8k_like")
    for split, n in (("train", 12), ("test", 6)):
        with open(d / f"gsm8k_{split}.jsonl", "w") as f:
            for i in range(n):
                a, b = 3 + i, 4 + 2 * i
                f.write(json.dumps({"question": f"Sam has {a} pens and buys {b} more. How many pens does Sam have?",
                                    "answer": f"Sam has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} pens.\n#### {a + b}"})
                        + "\n")
    return d


def _argv(tiny_model_dir, gsm_dir, tmp, **kw):
    argv = ["--quick", "--model", str(tiny_model_dir), "--data-dir", str(gsm_dir), "--work-dir", str(tmp / "work"),
            "--out", str(tmp / "docs" / "results.md"), "--steps", "1", "--prompts-per-step", "1", "--samples", "4",
            "--max-new-tokens", "8", "--eval-limit-synthetic", "4", "--eval-limit-gsm8k", "3",
            "--eval-max-new-tokens", "8", "--kl-prompts", "2", "--no-progress"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}", *([str(x) for x in v] if isinstance(v, (list, tuple)) else [str(v)])]
    return argv


def _finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


def test_quick_report_tables_plot_and_kl(cr, tiny_model_dir, gsm_dir, tmp_path, capsys):
    argv = _argv(tiny_model_dir, gsm_dir, tmp_path, recipes=["grpo", "dapo"], seeds=[2, 3],
                 tasks=["arithmetic", "gsm8k"], lr="1e-2")
    assert cr.main(argv) == 0
    md, js, png = tmp_path / "docs" / "results.md", tmp_path / "docs" / "results.json", \
        tmp_path / "docs" / "results_rewards.png"
    assert md.is_file() and js.is_file() and png.is_file() and png.stat().st_size > 10_000
    res = json.loads(js.read_text())
    assert sorted(res["runs"]) == sorted(f"{t}/{r}/seed{s}" for t in ("arithmetic", "gsm8k")
                                         for r in ("grpo", "dapo") for s in (2, 3))
    vocab = 384
    moved = 0
    for key, r in res["runs"].items():
        assert r["status"] == "ok", (key, r.get("error"))
        assert len(r["steps"]) == 1 and _finite(r["steps"][0]["reward_mean"])
        assert (Path(r["run_dir"]) / "metrics.jsonl").is_file() and not (Path(r["run_dir"]) / "checkpoints").exists()
        assert 0.0 <= r["eval"]["avg@1"] <= 1.0
        assert r["gen_tokens"] > 0 and r["kl_tokens"] > 0
        assert r["anchor_kind"] == {"grpo": "fixed", "dapo": "none"}[r["recipe"]]  # dapo has no KL, so no anchor
        assert _finite(r["kl_to_initial"]) and r["kl_to_initial"] >= 0.0
        assert _finite(r["entropy"]) and 0.0 < r["entropy"] <= math.log(vocab) + 1e-6
        # the weights move iff some gradient was non-zero: KL > 0 exactly then, else exactly 0 (a step
        # whose gradient is small moves the policy little: 5e-7 was measured on one CPU, so the bar is
        # the zero branch's 1e-9, not a size)
        if max(s["grad_norm"] for s in r["steps"]) > 0:
            assert r["kl_to_initial"] > 1e-9, key
            moved += 1
        else:
            assert r["kl_to_initial"] < 1e-9, key
    assert moved >= 1  # dapo's overlong shaping gives the random model a signal (not vacuous)
    for task in ("arithmetic", "gsm8k"):
        b = res["before"][task]
        assert 0.0 <= b["eval"]["avg@1"] <= 1.0 and b["kl_to_initial"] < 1e-9 and b["entropy"] > 0
    assert res["before"]["gsm8k"]["eval"]["n_problems"] == 3 and "test" in res["before"]["gsm8k"]["description"]
    # per-problem results and contents, for the clustered standard errors of Table 1
    for task, n in (("arithmetic", 4), ("gsm8k", 3)):
        b = res["before"][task]
        assert len(b["contents"]) == n and len(b["eval"]["correct"]) == n
        assert sum(b["eval"]["correct"]) == round(b["eval"]["avg@1"] * n)
    assert all(len(r["eval"]["correct"]) == r["eval"]["n_problems"] for r in res["runs"].values())

    text = md.read_text()
    for head in ("Table 1: held-out accuracy before and after", "Table 2: KL to the initial model and entropy",
                 "Table 3: trust regions, anchors and dynamics", "Table 4: per-run wall time and generated tokens",
                 "### Reading these numbers", "## Budgets"):
        assert head in text
    assert cr.PLACEHOLDER in text and "results_rewards.png" in text
    assert "bench/compare_recipes.py --quick" in text and "--lr 1e-2" in text  # the exact command
    assert res["commands"][0]["commit"] and f"(commit `{res['commands'][0]['commit']}`)" in text  # and its code
    # every table row of Table 1 carries numbers (not '-') for before and after
    t1 = text.split("## Table 1")[1].split("## Table 2")[0]
    rows = [ln for ln in t1.splitlines() if ln.startswith("| grpo") or ln.startswith("| dapo")]
    assert len(rows) == 4
    for ln in rows:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert all(re.fullmatch(r"\d+\.\d", c) for c in cells[1:3]), ln
    # the change's across-seed s.e. (the error of a training effect): sd of the seeds' changes / sqrt(seeds)
    for ln, (task, recipe) in zip(rows, [(t, r) for t in ("arithmetic", "gsm8k") for r in ("grpo", "dapo")]):
        acc = [res["runs"][f"{task}/{recipe}/seed{s}"]["eval"]["avg@1"] for s in (2, 3)]
        assert ln.split("|")[5].strip() == f"{100 * abs(acc[0] - acc[1]) / 2:.1f} (2)", ln  # n = 2: sd/sqrt2 = |d|/2
    t2 = text.split("## Table 2")[1].split("## Table 3")[0]
    kl_cells = re.findall(r"\| (grpo|dapo) \| ([0-9.e+-]+) \|", t2)
    assert len(kl_cells) == 4 and all(float(v) >= 0 for _, v in kl_cells)
    t3 = text.split("## Table 3")[1].split("## Table 4")[0]
    dyn = [ln for ln in t3.splitlines() if ln.startswith("| grpo") or ln.startswith("| dapo")]
    assert len(dyn) == 4 and all(" -> " in ln and "| - |" not in ln for ln in dyn), dyn
    t4 = text.split("## Table 4")[1]
    assert sum(ln.startswith("| arithmetic") or ln.startswith("| gsm8k") for ln in t4.splitlines()) == 8

    # --report-only re-renders from the JSON without running anything
    md.unlink()
    png.unlink()
    assert cr.main(argv + ["--report-only"]) == 0
    assert md.read_text() == text and png.is_file()
    # a hand-written reading survives the next re-render; the tables are rewritten around it
    reading = "grpo and dapo moved by less than one standard error."
    md.write_text(text.replace(cr.PLACEHOLDER, reading).replace("## Table 1", "## Table 1 (stale)"))
    assert cr.main(argv + ["--report-only"]) == 0
    assert md.read_text() == text.replace(cr.PLACEHOLDER, reading)


def test_clustered_se(cr):
    """Independent problems: the usual standard error (with the C/(C-1) factor); problems that share a
    content and agree: the error of C draws, not n."""
    b = [1, 0] * 50
    assert cr.clustered_se(b, None, [str(i) for i in range(100)]) == pytest.approx(math.sqrt(0.25 / 99))
    same = [1] * 50 + [0] * 50
    assert cr.clustered_se(same, None, [str(i // 10) for i in range(100)]) == pytest.approx(math.sqrt(0.25 / 9))
    # paired: identical before and after -> 0; one content flips from wrong to right -> its cluster carries it
    assert cr.clustered_se(same, same, [str(i // 10) for i in range(100)]) == 0
    assert cr.clustered_se([0] * 4, [1, 1, 0, 0], ["a", "a", "b", "b"]) == pytest.approx(0.5)
    assert cr.clustered_se([1], None, ["a"]) is None


def test_lr0_has_zero_kl_and_a_crash_is_recorded(cr, tiny_model_dir, gsm_dir, tmp_path, monkeypatch):
    real = cr.running.one_run  # the driver (bench/recipes_compare/running.py) calls it per run

    def one_run(a, task, recipe, seed, *args):
        if recipe == "grpo":
            raise RuntimeError("injected failure")
        return real(a, task, recipe, seed, *args)

    monkeypatch.setattr(cr.running, "one_run", one_run)
    # dapo seed 2 gets a learning signal on the first step (its overlong shaping separates the samples;
    # which seeds do depends on the sampler's RNG stream: 2, 3, 4 and 7 of 0-7 do)
    argv = _argv(tiny_model_dir, gsm_dir, tmp_path, recipes=["grpo", "dapo"], seeds=[2], tasks=["arithmetic"],
                 lr=0)
    assert cr.main(argv) == 1  # one run failed
    res = json.loads((tmp_path / "docs" / "results.json").read_text())
    bad, ok = res["runs"]["arithmetic/grpo/seed2"], res["runs"]["arithmetic/dapo/seed2"]
    assert bad["status"] == "failed" and "injected failure" in bad["error"]
    assert ok["status"] == "ok"
    # lr = 0: a non-zero gradient, but the final policy is the initial model, so its KL to it is 0 and the
    # greedy accuracy is unchanged
    assert ok["steps"][0]["grad_norm"] > 0
    assert ok["kl_to_initial"] < 1e-6 and ok["kl_tokens"] > 0
    assert ok["eval"]["avg@1"] == res["before"]["arithmetic"]["eval"]["avg@1"]
    text = (tmp_path / "docs" / "results.md").read_text()
    assert "failed: `RuntimeError: injected failure`" in text


def test_exact_kl_matches_full_logits(cr, tiny_model_dir):
    from tether.models import ModelConfig, load_model
    from tether.rollout import SamplingParams
    from tether.rollout.hf import HFEngine

    init, tok = load_model(ModelConfig(name=str(tiny_model_dir)))
    pol = copy.deepcopy(init)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in pol.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    prompts = [tok("What is 2 + 2?")["input_ids"], tok("Hello world! Compute 12 * 7")["input_ids"],
               tok("the quick brown fox")["input_ids"]]
    rb = HFEngine(pol, tok).generate(prompts, SamplingParams(n=1, temperature=1.0, max_new_tokens=10, seed=3))
    out = cr.token_kl_entropy(pol, init, rb, micro=2)

    ids, mask = rb.input_ids()
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    P, T = rb.prompt_ids.shape[1], rb.response_ids.shape[1]
    with torch.no_grad():
        lp = torch.log_softmax(pol(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits.double(), -1)
        lq = torch.log_softmax(init(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits.double(), -1)
    lp, lq = lp[:, P - 1:P + T - 1], lq[:, P - 1:P + T - 1]
    m = rb.response_mask
    kl = (lp.exp() * (lp - lq)).sum(-1)[m]
    ent = -(lp.exp() * lp).sum(-1)[m]
    assert out["kl_tokens"] == int(m.sum()) > 0
    assert out["kl_to_initial"] == pytest.approx(float(kl.mean()), rel=1e-4, abs=1e-7)
    assert out["entropy"] == pytest.approx(float(ent.mean()), rel=1e-4)
    assert out["kl_to_initial"] > 1e-3
    assert cr.token_kl_entropy(init, init, rb)["kl_to_initial"] == 0.0


def test_missing_gsm8k_is_a_clear_error(cr, tiny_model_dir, tmp_path):
    with pytest.raises(SystemExit, match="lacks gsm8k_train.jsonl, gsm8k_test.jsonl"):
        cr.main(_argv(tiny_model_dir, tmp_path / "nothing_here", tmp_path, tasks=["gsm8k"]))


def test_anchor_updates_cell(cr):
    """Table 3 counts EMA updates; the iterative anchor (RPG's: the sampler itself) has none to count."""
    ema = [{"algo": "ema_pg: ... anchor=ema(eta=0.95, every=4) ...", "steps": [{"anchor_updates": 4}]}] * 2
    fixed = [{"algo": "grpo: ... anchor=fixed ...", "steps": [{"anchor_updates": 0}]}]
    rpg = [{"algo": "rpg_reinforce_urkl: ... anchor=iterative aggregation=token-mean",
            "steps": [{"anchor_updates": 0}]}]
    assert cr.anchor_updates_cell(ema) == "4"
    assert cr.anchor_updates_cell(fixed) == "0"
    assert cr.anchor_updates_cell(rpg) == "every step (sampler)"
    # records made since the run stores its anchor kind: the stored kind decides, not the description
    assert cr.anchor_updates_cell([{"anchor_kind": "iterative", "algo": "x", "steps": [{}]}]) == "every step (sampler)"
    assert cr.anchor_updates_cell([{"anchor_kind": "ema", "algo": "anchor=iterative",
                                    "steps": [{"anchor_updates": 3}]}]) == "3"
    assert cr.anchor_updates_cell(ema + rpg) == "2"  # a mixed set is counted, not called the sampler


def test_variant_runs_under_its_label_and_resume_merges_parts(cr, tiny_model_dir, gsm_dir, tmp_path, capsys):
    """--variant: a recipe with changed settings runs under its own label (its overrides reach the trainer
    and are recorded); a later --resume with other recipes and seeds adds to the report instead of
    replacing it; redefining a label that has runs is refused."""
    variant = ["--variant", "grpo_tm", "grpo", "algo.aggregation=token-mean"]
    argv = _argv(tiny_model_dir, gsm_dir, tmp_path, recipes=["grpo_tm"], seeds=[2], tasks=["arithmetic"]) + variant
    assert cr.main(argv) == 0
    js, md = tmp_path / "docs" / "results.json", tmp_path / "docs" / "results.md"
    r = json.loads(js.read_text())["runs"]["arithmetic/grpo_tm/seed2"]
    assert r["status"] == "ok" and r["variant"] == {"recipe": "grpo", "overrides": {"algo.aggregation": "token-mean"}}
    assert r["algo"].startswith("grpo") and "aggregation=token-mean" in r["algo"] and r["anchor_kind"] == "fixed"
    assert Path(r["run_dir"]).name == "grpo_tm-seed2"
    # the second part: the plain recipe, another seed; the first part's run is reused, not rerun
    argv2 = _argv(tiny_model_dir, gsm_dir, tmp_path, recipes=["grpo"], seeds=[3], tasks=["arithmetic"])
    assert cr.main(argv2 + ["--resume"]) == 0
    res = json.loads(js.read_text())
    assert sorted(res["runs"]) == ["arithmetic/grpo/seed3", "arithmetic/grpo_tm/seed2"]
    assert "aggregation=seq-mean-token-mean" in res["runs"]["arithmetic/grpo/seed3"]["algo"]
    assert res["settings"]["recipes"] == ["grpo_tm", "grpo"] and res["settings"]["seeds"] == [2, 3]
    assert [c["runs_run"] for c in res["commands"]] == [1, 1]
    text = md.read_text()
    assert "variants (`--variant`): 'grpo_tm' = grpo with algo.aggregation=token-mean" in text
    # one task compared: the budget names its steps only; grpo brings no trainer settings of its own
    assert "trainer steps arithmetic 1 x" in text and "gsm8k 1" not in text
    assert "`tether.config.RECIPE_TRAINER_DEFAULTS`): none\n" in text
    t1 = text.split("## Table 1")[1].split("## Table 2")[0]
    assert any(ln.startswith("| grpo_tm |") for ln in t1.splitlines())
    assert any(ln.startswith("| grpo |") for ln in t1.splitlines())
    # a JSON whose settings name only its last part (as this script wrote before it merged them) still
    # reports every run it holds, in the order they ran
    res["settings"].update(recipes=["grpo"], seeds=[3])
    js.write_text(json.dumps(res))
    md.unlink()
    assert cr.main(argv2 + ["--report-only"]) == 0
    t1 = md.read_text().split("## Table 1")[1].split("## Table 2")[0]
    assert [ln.split("|")[1].strip() for ln in t1.splitlines() if ln.startswith("| grpo")] == ["grpo_tm", "grpo"]
    # the label already names runs made with token-mean: another definition is refused before any run
    argv3 = _argv(tiny_model_dir, gsm_dir, tmp_path, recipes=["grpo_tm"], seeds=[3], tasks=["arithmetic"])
    with pytest.raises(SystemExit, match="grpo_tm/seed2 .* was made as 'grpo_tm' = grpo with algo.aggregation"):
        cr.main(argv3 + ["--resume", "--variant", "grpo_tm", "grpo", "algo.aggregation=seq-mean-token-sum"])


@pytest.mark.parametrize("variant, message", [
    (["x", "grpo"], "give LABEL RECIPE KEY=VALUE"),
    (["dapo", "grpo", "train.lr=1"], "already a recipe"),
    (["x", "nope", "train.lr=1"], "unknown recipe 'nope'"),
    (["x", "grpo", "algo.aggregation=nope"], "unknown algo.aggregation 'nope'"),
    (["x/y", "grpo", "train.lr=1"], "letters, digits"),
])
def test_bad_variant_is_a_clear_error(cr, variant, message, capsys):
    with pytest.raises(SystemExit):
        cr.parse_args(["--recipes", variant[0], "--variant", *variant])
    assert message in capsys.readouterr().err


def test_variant_must_be_compared(cr, capsys):
    with pytest.raises(SystemExit):
        cr.parse_args(["--recipes", "grpo", "--variant", "x", "grpo", "train.lr=1"])
    assert "--variant x is defined but not named in --recipes" in capsys.readouterr().err


def test_recipe_trainer_text(cr):
    assert cr.recipe_trainer_text({}) == cr.recipe_trainer_text({"grpo": {}}) == "none"
    text = cr.recipe_trainer_text({"grpo": {}, "dapo": {"rollout.dynamic_sampling": True},
                                   "rpg_reinforce_urkl": {"train.mini_batches": 2}})
    assert text.startswith("dapo: `rollout.dynamic_sampling=True`; rpg_reinforce_urkl: `train.mini_batches=2`. ")
    assert "Dynamic sampling generates more" in text
    assert "Dynamic sampling" not in cr.recipe_trainer_text({"rpg_reinforce_urkl": {"train.mini_batches": 2}})
