"""The command line: ``python -m tether`` runs the same CLI as the ``tether`` script."""

from helpers import run_module
from tether.config.recipes import RECIPES


def test_python_m_tether_help_lists_subcommands():
    r = run_module("--help")
    assert r.returncode == 0, r.stdout + r.stderr
    for cmd in ("train", "eval", "plot", "config", "recipes"):
        assert cmd in r.stdout, (cmd, r.stdout)


def test_train_task_choices_include_search_in_a_fresh_process():
    """`tether train --task search` (the README's command): the search task's preset registers when tether.search is
    imported, so the choices must be read after it (a fresh interpreter, as a user runs it)."""
    r = run_module("train", "--help")
    assert r.returncode == 0, r.stderr
    assert "--task {organism,math,search}" in r.stdout


def test_config_prints_what_train_would_run_with_the_same_arguments(capsys):
    """`tether config` takes `tether train`'s config arguments (--task, --model, --data, --steps, --output-dir), so
    it prints the config of the same train command: here the organism preset with a step count given twice the
    same way, and a flag and an override that disagree are refused as train refuses them."""
    import yaml

    from tether.cli import main
    from tether.config import to_dict
    from tether.resolve import load_config

    args = ["--task", "organism", "--steps", "7", "--output-dir", "/tmp/x", "--recipe", "grpo", "algo.kl.beta=0.01"]
    assert main(["config", *args]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    expected = to_dict(load_config(None, {"algo.kl.beta": 0.01, "train.steps": 7, "run.output_dir": "/tmp/x"},
                                   recipe_name="grpo", task="organism"))
    assert printed == expected
    assert printed["model"]["name"] == "organism" and printed["train"]["steps"] == 7 \
        and printed["rollout"]["max_new_tokens"] == 48 and printed["recipe"] == "grpo"
    assert main(["config", "--steps", "7", "train.steps=8"]) == 2
    assert "--steps 7 and train.steps=8 set the same key" in capsys.readouterr().err


def test_python_m_tether_recipes():
    r = run_module("recipes")
    assert r.returncode == 0, r.stdout + r.stderr
    names = [line.split(":")[0] for line in r.stdout.splitlines() if line.strip()]
    assert names == list(RECIPES)


def test_train_prints_held_out_accuracy_before_and_after(tiny_model_dir, tmp_path):
    """What a newcomer sees at the end of ``tether train`` on arithmetic: the held-out accuracy of the
    initial model and of the trained one, the same numbers as metrics.jsonl's step-0 and last rows."""
    import json

    run = tmp_path / "run"
    r = run_module("train", "--model", str(tiny_model_dir), "--output-dir", str(run), "--steps", "1",
                   "rollout.n=2", "rollout.prompts_per_step=2", "rollout.max_new_tokens=4", "eval.limit=3",
                   "eval.max_new_tokens=4", "run.progress=false", "run.plot=false", "run.save_every=0")
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    before, after = rows[0]["eval/arithmetic/avg@1"], rows[-1]["eval/arithmetic/avg@1"]
    assert f"[tether] held-out before training: arithmetic {100 * before:.1f} % (3 problems)" in r.stdout, r.stdout
    assert (f"[tether] held-out accuracy, before -> after training: arithmetic (3 problems, greedy, 4 tokens): "
            f"{100 * before:.1f} % -> {100 * after:.1f} % (step 1)") in r.stdout, r.stdout
