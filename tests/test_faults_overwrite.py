"""Nothing a user owns is ever deleted or overwritten (tether.rundir.owned, the one rule for ``--overwrite``):
train's and export's ``--overwrite`` and eval's ``--out`` replace only what tether wrote; a failed
``--overwrite`` keeps the old run; an explicitly named checkpoint is verified; a stopped evaluation
keeps the problems it finished; output paths are checked before the model loads.

Every case runs the real CLI in a subprocess (``python -m tether``) on the tiny random model."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import (
    DIGITS,
    FAULTS,
    assert_clean_error,
    cli_args,
    copy_run,
    rows,
    run_module,
    subprocess_env,
    tiny_config,
)
from tether.testing import make_tiny_model_dir
from tether.train import train

pytestmark = pytest.mark.faults

MARKER = ".tether.json"  # tether.rundir.owned.MARKER

SLOW_REWARD = '''
import time

def slow_digits(completion, example):
    time.sleep(0.05)
    return float(any(c.isdigit() for c in completion))
'''


@pytest.fixture(scope="module")
def work(make_workdir):
    return make_workdir("faults_overwrite", DIGITS)


@pytest.fixture(scope="module")
def base_run(work, tiny_model_dir, tmp_path_factory):
    """2 steps of the fault tests' tiny run (helpers.FAULTS), checkpoints step-1 and step-2."""
    return train(tiny_config(work, tiny_model_dir, "ema_pg", 2, **FAULTS), tmp_path_factory.mktemp("base") / "run",
                 log=lambda *a: None)


def tree(d: Path) -> dict:
    """Every file under ``d`` with its bytes (what must be left untouched)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def export(*args):
    return run_module("export", *args)


# ---------------------------------------------------------------- --overwrite: only what tether wrote


@pytest.mark.slow  # about 15 s: out of the default suite's 15 minutes, run by CI's slow step
def test_export_overwrite_refuses_a_directory_tether_did_not_write(base_run, tmp_path):
    """Item 1: ``tether export RUN OUT --overwrite`` deleted any non-empty OUT (thesis.tex and sub/ gone)."""
    mine = tmp_path / "u"
    (mine / "sub").mkdir(parents=True)
    (mine / "thesis.tex").write_text("precious")
    before = tree(mine)
    r = export(base_run, mine, "--overwrite")
    assert_clean_error(r.returncode, r.stderr, str(mine), "not written by tether", "thesis.tex")
    assert tree(mine) == before and (mine / "sub").is_dir()
    # an earlier export is replaced; one a file was added to is refused, the file kept
    out = tmp_path / "exp"
    assert export(base_run, out).returncode == 0 and json.loads((out / MARKER).read_text())["kind"] == "export"
    r = export(base_run, out, "--overwrite", "--step", "1")
    assert r.returncode == 0, r.stderr
    assert "step 1" in (out / "README.md").read_text()
    (out / "notes.md").write_text("mine")
    r = export(base_run, out, "--overwrite")
    assert_clean_error(r.returncode, r.stderr, "notes.md", "did not write")
    assert (out / "notes.md").read_text() == "mine" and (out / "config.json").is_file()


def test_train_overwrite_refuses_a_directory_with_only_a_config_of_yours(work, tiny_model_dir, tmp_path):
    """Item 2: a user's config.yaml was enough for --overwrite to empty the directory (src/ gone)."""
    p = tmp_path / "p"
    (p / "src").mkdir(parents=True)
    (p / "config.yaml").write_text("train:\n  steps: 1\n")
    (p / "src" / "model.py").write_text("x")
    before = tree(p)
    r = run_module(*cli_args(work, tiny_model_dir, p, 1, **FAULTS), "--config", p / "config.yaml", "--overwrite")
    assert_clean_error(r.returncode, r.stderr, str(p), "not written by tether")
    assert tree(p) == before


def test_train_overwrite_refuses_a_run_you_added_files_to(work, tiny_model_dir, base_run, tmp_path):
    run = copy_run(base_run, tmp_path / "run")
    (run / "notes.txt").write_text("mine")
    before = tree(run)
    r = run_module(*cli_args(work, tiny_model_dir, run, 1, **FAULTS), "--overwrite")
    assert_clean_error(r.returncode, r.stderr, "notes.txt", "did not write")
    assert tree(run) == before


@pytest.mark.slow  # about 15 s: out of the default suite's 15 minutes, run by CI's slow step
def test_failed_overwrite_keeps_the_old_run(work, tiny_model_dir, base_run, tmp_path):
    """Item 3: --overwrite deleted the old run before the new model loaded; a model that failed to load
    left an empty directory. Now the old run is set aside and put back."""
    run = copy_run(base_run, tmp_path / "run")
    broken = tmp_path / "broken_model"
    make_tiny_model_dir(broken)
    w = broken / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])  # truncated
    before = tree(run)
    r = run_module(*cli_args(work, broken, run, 1, **FAULTS), "--overwrite")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert tree(run) == before
    assert not [p for p in run.iterdir() if p.name.startswith(".tether-replaced-") or p.name == ".lock"]
    # and a good --overwrite replaces it
    r = run_module(*cli_args(work, tiny_model_dir, run, 1, **FAULTS), "--overwrite")
    assert r.returncode == 0, r.stderr
    assert [x["step"] for x in rows(run)] == [1] and "deleted the previous run" in r.stdout + r.stderr
    assert sorted(p.name for p in run.iterdir()) == [MARKER, "checkpoints", "config.yaml", "metrics.jsonl",
                                                     "samples.jsonl"]


# ---------------------------------------------------------------- explicit checkpoints are verified


def test_an_explicit_damaged_checkpoint_is_refused_by_eval_and_export(work, base_run, tmp_path):
    """Item 4: eval --model RUN/checkpoints/step-N and export --step N loaded a flipped byte silently."""
    run = copy_run(base_run, tmp_path / "run")
    ckpt = run / "checkpoints" / "step-000001"
    f = ckpt / "policy.safetensors"
    data = bytearray(f.read_bytes())
    data[-10] ^= 0xFF
    f.write_bytes(bytes(data))
    r = run_module("eval", "--model", ckpt, "--benchmarks", work / "prompts.jsonl", "--prompt-key", "question",
                   "--answer-key", "answer", "--reward", f"{work / 'rew.py'}:digits", "--greedy",
                   "--out", tmp_path / "ev")
    assert_clean_error(r.returncode, r.stderr, str(ckpt), "damaged", "sha256")
    assert not (tmp_path / "ev").exists()
    r = export(run, tmp_path / "exp", "--step", "1")
    assert_clean_error(r.returncode, r.stderr, str(ckpt), "damaged", "available: 2; damaged: 1")
    assert not (tmp_path / "exp").exists()


# ---------------------------------------------------------------- eval --out


def eval_args(work, model, out, *extra, bench=None):
    return ["eval", "--model", model, "--benchmarks", bench or (work / "prompts.jsonl"), "--prompt-key", "question",
            "--answer-key", "answer", "--reward", f"{work / 'rew.py'}:digits", "--greedy", "--max-new-tokens", "4",
            "--no-progress", "--out", out, *extra]


@pytest.mark.slow  # about 20 s: out of the default suite's 15 minutes, run by CI's slow step
def test_eval_out_never_writes_into_a_run_or_a_directory_of_yours(work, base_run, tmp_path):
    """Item 5: eval --out into a live run's directory overwrote its samples.jsonl (a benchmark named
    samples); --out was checked neither for emptiness nor for a lock."""
    run = copy_run(base_run, tmp_path / "run")
    bench = tmp_path / "samples.jsonl"
    bench.write_text((work / "prompts.jsonl").read_text())
    before = tree(run)
    r = run_module(*eval_args(work, run, run, bench=bench))
    assert_clean_error(r.returncode, r.stderr, str(run), "training run")
    r = run_module(*eval_args(work, run, run, "--overwrite", bench=bench))
    assert_clean_error(r.returncode, r.stderr, str(run), "training run")
    assert tree(run) == before
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "samples.jsonl").write_text("mine")
    for extra in ((), ("--overwrite",)):
        r = run_module(*eval_args(work, run, mine, *extra, bench=bench))
        assert r.returncode == 2 and "Traceback" not in r.stderr and str(mine) in r.stderr, r.stderr
    assert (mine / "samples.jsonl").read_text() == "mine"
    # an earlier evaluation is replaced with --overwrite, and only then
    ev = tmp_path / "ev"
    assert run_module(*eval_args(work, run, ev)).returncode == 0
    r = run_module(*eval_args(work, run, ev))
    assert_clean_error(r.returncode, r.stderr, "not empty", "--overwrite")
    r = run_module(*eval_args(work, run, ev, "--overwrite"))
    assert r.returncode == 0, r.stderr
    assert json.loads((ev / "results.json").read_text())["benchmarks"]["prompts"]["metrics"]["n_problems"] == 40


def test_eval_out_paths_are_checked_before_the_model_loads(work, tmp_path):
    """Item 11: eval --out onto an existing file or an unwritable place gave a traceback after the model
    loaded. The model named here does not exist: a check after the load would report the model instead."""
    missing_model = tmp_path / "no_model.gguf"
    missing_model.write_text("not a model")
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    for out, needle in ((a_file, "not a directory"), (a_file / "sub", "cannot write"),
                        (Path("/proc/tether-test-out"), "cannot write")):
        r = run_module(*eval_args(work, missing_model, out))
        assert_clean_error(r.returncode, r.stderr, str(out), needle)
    assert a_file.read_text() == "x"


def test_sigterm_keeps_the_finished_problems_of_an_evaluation(work, base_run, tmp_path):
    """Item 6: SIGTERM killed `tether eval` at once, saved nothing and left an empty --out. Now the batch
    in progress finishes, the finished problems are written (results.json marked incomplete), exit 143."""
    (tmp_path / "slow.py").write_text(SLOW_REWARD)
    bench = tmp_path / "many.jsonl"
    bench.write_text("".join(json.dumps({"question": f"Count to {i}", "answer": str(i)}) + "\n" for i in range(400)))
    out = tmp_path / "ev"
    args = eval_args(work, base_run, out, "--batch-size", "4", bench=bench)
    args[args.index("--reward") + 1] = f"{tmp_path / 'slow.py'}:slow_digits"
    p = subprocess.Popen([sys.executable, "-m", "tether", *map(str, args)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        deadline = time.time() + 240
        part = out / "many.jsonl"
        while (time.time() < deadline and p.poll() is None
               and not (part.is_file() and part.read_text().count("\n") >= 8)):
            time.sleep(0.1)
        assert p.poll() is None, p.communicate()
        p.send_signal(signal.SIGTERM)
        stdout, stderr = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr and "SIGTERM" in stderr
    res = json.loads((out / "results.json").read_text())
    b = res["benchmarks"]["many"]
    assert res["stopped"] == "SIGTERM" and b["complete"] is False and b["n_problems_total"] == 400
    kept = [json.loads(x) for x in part.read_text().splitlines()]
    assert 8 <= len(kept) == b["metrics"]["n_problems"] < 400
    assert all(len(r["responses"]) == 1 for r in kept)


# ---------------------------------------------------------------- export paths, before the model loads


def test_export_output_paths_are_clean_errors(base_run, tmp_path):
    """Item 11: export under a read-only parent or to a symlinked target gave a traceback."""
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    r = export(base_run, a_file / "out")
    assert_clean_error(r.returncode, r.stderr, "cannot write the export", str(a_file / "out"))
    r = export(base_run, "/proc/tether-test-export")
    assert_clean_error(r.returncode, r.stderr, "cannot write the export")
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    r = export(base_run, link)
    assert_clean_error(r.returncode, r.stderr, str(link), "symbolic link")
    assert link.is_symlink() and list(real.iterdir()) == []


def test_export_onto_a_full_disk_is_a_clean_error(base_run, tmp_path):
    """Item 11: a real write failure (RLIMIT_FSIZE, what safetensors reports as SafetensorError) gave a
    traceback; now one line, and no half-written export or temp directory is left."""
    out = tmp_path / "exp"
    code = ("import resource, sys; from tether.cli import main; "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536)); sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "export", str(base_run), str(out)], capture_output=True,
                       text=True, env=subprocess_env(), timeout=300)
    assert_clean_error(r.returncode, r.stderr, "cannot write the export", str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


# ---------------------------------------------------------------- resume and the first checkpoint


def test_resume_refuses_a_recipe_override(work, tiny_model_dir, base_run, tmp_path):
    """Item 7: `--resume RUN recipe=grpo` exited 0 and silently kept the old recipe."""
    run = copy_run(base_run, tmp_path / "run")
    before = tree(run)
    r = run_module("train", "--resume", run, "recipe=grpo", "train.steps=3")
    assert_clean_error(r.returncode, r.stderr, "recipe=grpo", "ema_pg")
    r = run_module("train", "--resume", run, "--output-dir", tmp_path / "elsewhere")
    assert_clean_error(r.returncode, r.stderr, "run.output_dir")
    assert tree(run) == before and not (tmp_path / "elsewhere").exists()


@pytest.mark.slow  # about 13 s: out of the default suite's 15 minutes, run by CI's slow step
def test_disk_full_at_the_first_checkpoint_advises_what_works(work, tiny_model_dir, tmp_path):
    """Item 14: a disk that filled at the first checkpoint advised --resume, which then refused (no
    checkpoint). The advice is now to start again with --overwrite, and that command works."""
    run = tmp_path / "run"
    code = ("import resource, sys; from tether.cli import main; "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536)); sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, *cli_args(work, tiny_model_dir, run, 2, **FAULTS)],
                       capture_output=True, text=True, env=subprocess_env(), timeout=300)
    err = assert_clean_error(r.returncode, r.stderr, "File too large", "--overwrite", str(run))
    assert "--resume" not in err
    r = run_module(*cli_args(work, tiny_model_dir, run, 2, **FAULTS), "--overwrite")
    assert r.returncode == 0, r.stderr
    assert [x["step"] for x in rows(run)] == [1, 2]


def test_refusals_name_the_kind_with_its_article(tmp_path):
    """"not an export", "not an evaluation output", "a training run" (was "not a export")."""
    from tether.errors import OutputError
    from tether.rundir.owned import check_replaceable, write_marker

    d = tmp_path / "out"
    d.mkdir()
    (d / "x.json").write_text("{}")
    write_marker(d, "run", ["x.json"])
    for kind, phrase in [("export", "not an export"), ("eval", "not an evaluation output"),
                         ("sft", "not a supervised fine-tuning run")]:
        with pytest.raises(OutputError, match=f"is a tether training run, {phrase}: --overwrite will not replace it"):
            check_replaceable(d, kind)
