"""Faults of the probe of issue #51 at the edges of the sweep, its report, eval and the organism: nothing of the
user's is overwritten by a report, an unusable destination is one error line before the work, and a damaged
record, cache entry or argument is named instead of a traceback.

The report and spec cases run ``tether.cli.main`` in this process (the same code path as ``python -m tether``,
seconds faster; nothing there loads a model); kills run real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import DIGITS, assert_clean_error, run_module, subprocess_env, tiny_settings
from test_sweep import _synthetic
from tether.cli import main
from tether.errors import ModelLoadError
from tether.organism import OrganismSpec
from tether.organism import build as organism_build
from tether.sweep import layout

pytestmark = pytest.mark.faults


def cli(capsys, *args):
    """``tether ARGS`` in this process: (exit code, stdout, stderr)."""
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def synth(d: Path) -> Path:
    """A synthetic sweep directory (test_sweep's: two arms of done runs, one failed, one missing)."""
    d.mkdir()
    return _synthetic(d)


def files(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- the report never replaces a file of yours


def test_report_out_refuses_your_files_and_replaces_its_own(tmp_path, capsys):
    """Defect 1: ``tether sweep report --out keep.md`` replaced the user's keep.md and keep.json and wrote keep.png,
    exit 0. Now it is refused before anything is computed, every file untouched; the report's own files (and a
    report of before the marks) are replaced."""
    s = synth(tmp_path / "S")
    mine = tmp_path / "mine"
    mine.mkdir()
    for name, text in (("keep.md", "# my notes\n"), ("keep.json", '{"mine": 1}\n')):
        (mine / name).write_text(text)
        before = files(mine)
        rc, out, err = cli(capsys, "sweep", "report", s, "--out", mine / "keep.md", "--reps", "50")
        assert_clean_error(rc, err, str(mine / name), "not written by tether sweep report", line_only=True)
        assert files(mine) == before and out == ""
        (mine / name).unlink()
    # its own output: written with tether's mark, then replaced by the next report
    md = tmp_path / "rep" / "r.md"
    for _ in range(2):
        rc, out, err = cli(capsys, "sweep", "report", s, "--out", md, "--reps", "50")
        assert rc == 0, err
    from tether.userio import mark_line  # here, so that the other cases run on the code before the rule (#51)

    assert md.read_text().splitlines()[0] == mark_line("sweep report")
    assert json.loads(md.with_suffix(".json").read_text())["tether"] == "sweep report"
    assert b"written by tether sweep report" in md.with_suffix(".png").read_bytes()[:4096]
    # a report written before reports carried the mark (docs/evidence/*.md) is still tether's to replace
    old = tmp_path / "old"
    old.mkdir()
    (old / "r.md").write_text("# Sweep report: x\n\nWritten by `tether sweep report` from `S`: 2 arm(s)\n")
    (old / "r.json").write_text(json.dumps({"sources": [], "settings": {}, "results": []}))
    (old / "r.png").write_bytes(b"\x89PNG\r\n\x1a\n....")
    rc, _, err = cli(capsys, "sweep", "report", s, "--out", old / "r.md", "--reps", "50")
    assert rc == 0, err
    # a PNG of yours beside a report of ours is still yours
    (old / "r.png").write_bytes(b"\x89PNG\r\n\x1a\nmine")
    (old / "r.md").write_text("# my own report\n")
    rc, _, err = cli(capsys, "sweep", "report", s, "--out", old / "r.md", "--reps", "50")
    assert_clean_error(rc, err, "r.md", "not written by tether")


def _unwritable(t: Path) -> list[Path]:
    """Places no one can write, root included: under a regular file, and under /proc."""
    (t / "a_file").write_text("not a directory")
    outs = [t / "a_file" / "r.md"]
    if Path("/proc/self").is_dir():
        outs.append(Path("/proc/tether-test") / "r.md")
    return outs


def test_report_out_in_an_unwritable_place_is_refused_before_the_work(tmp_path, capsys, monkeypatch):
    """Defect 5: a PermissionError traceback on the .png after the whole report was computed. Now one error line,
    and nothing is computed (the statistics are never called)."""
    s = synth(tmp_path / "S")
    from tether.sweep import report as report_module

    def never(*a, **k):
        raise AssertionError("the report was computed before its destination was checked")

    monkeypatch.setattr(report_module, "compute", never)
    for out in _unwritable(tmp_path):
        rc, stdout, err = cli(capsys, "sweep", "report", s, "--out", out)
        assert_clean_error(rc, err, f"cannot write {out}", line_only=True)
        assert stdout == ""


def test_report_on_damaged_records_names_each_file(tmp_path, capsys):
    """Defect 4 (a record nested 100,000 deep was a RecursionError traceback) and the weaker edge (a corrupt,
    truncated or empty record was silently counted as incomplete): each is a warning naming the file, the run
    counted incomplete, and the report is written."""
    s = synth(tmp_path / "S")
    damaged = {("A", 0): "[" * 100_000, ("A", 1): '{"state": "do', ("A", 2): "", ("B", 0): '["done"]'}
    for (arm, seed), text in damaged.items():
        layout.record_path(s, arm, seed).write_text(text)
    md = tmp_path / "r.md"
    rc, _, err = cli(capsys, "sweep", "report", s, "--out", md, "--reps", "50")
    assert rc == 0 and "Traceback" not in err, err
    for arm, seed in damaged:
        assert str(layout.record_path(s, arm, seed)) in err, err
    assert "nested too deeply" in err and "counts as not finished" in err
    assert "incomplete (not counted): A seed 0" in md.read_text()


def test_report_arguments(tmp_path, capsys):
    """Weaker edges: --collapse-drop -1 was accepted (then every run collapsed); `report` on a file said "no such
    directory"."""
    s = synth(tmp_path / "S")
    with pytest.raises(SystemExit) as e:
        main(["sweep", "report", str(s), "--collapse-drop", "-1"])
    assert e.value.code == 2 and "--collapse-drop: must be a finite number >= 0" in capsys.readouterr().err
    rc, _, err = cli(capsys, "sweep", "report", s / "sweep.json")
    assert_clean_error(rc, err, "is not a sweep directory: it is a file", line_only=True)
    rc, _, err = cli(capsys, "sweep", "report", tmp_path / "nope")
    assert_clean_error(rc, err, "no such directory", line_only=True)


# ---------------------------------------------------------------- tether sweep --out


@pytest.fixture
def spec(make_workdir, tiny_model_dir, tmp_path):
    work = make_workdir("faults_reports", DIGITS)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"base": {"overrides": tiny_settings(work, tiny_model_dir, 1)}, "seeds": 1}))
    return path


def test_sweep_out_that_cannot_be_a_directory_is_one_error_line(spec, tmp_path, capsys):
    """Defects 2 and 3: ``--out afile.txt`` (an existing file) was a FileExistsError traceback, and ``--out`` under
    a directory the user cannot write a PermissionError traceback, both from the lock's mkdir."""
    afile = tmp_path / "afile.txt"
    afile.write_text("mine")
    rc, _, err = cli(capsys, "sweep", spec, "--out", afile)
    assert_clean_error(rc, err, f"--out {afile} is a file, not a directory", line_only=True)
    assert afile.read_text() == "mine"
    for out in _unwritable(tmp_path):
        rc, _, err = cli(capsys, "sweep", spec, "--out", out.parent / "S")
        assert_clean_error(rc, err, "cannot write --out", line_only=True)


def test_a_refused_sweep_out_keeps_nothing(spec, tmp_path, capsys):
    """Weaker edge: a refused ``--out`` left ``.sweep-1-of-1.lock`` in the user's directory; and a directory with a
    ``runs/`` of its own is not written into."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "sweep.json").write_text('{"my": "own file"}')
    before = files(mine)
    rc, _, err = cli(capsys, "sweep", spec, "--out", mine)
    assert_clean_error(rc, err, "not a sweep's sweep.json")
    assert files(mine) == before and sorted(p.name for p in mine.iterdir()) == ["sweep.json"]
    (mine / "sweep.json").unlink()
    (mine / "runs").mkdir()
    (mine / "runs" / "notes.txt").write_text("mine")
    rc, _, err = cli(capsys, "sweep", spec, "--out", mine)
    assert_clean_error(rc, err, "holds entries tether did not write")
    assert sorted(p.name for p in mine.iterdir()) == ["runs"]


def test_seeds_true_is_named_as_a_boolean(tmp_path, capsys):
    p = tmp_path / "s.yaml"
    p.write_text("seeds: true\n")
    rc, _, err = cli(capsys, "sweep", p, "--dry-run")
    assert_clean_error(rc, err, "seeds: expected a count >= 1", "got true (a boolean)", line_only=True)
    assert "required" not in err


# ---------------------------------------------------------------- eval, config and CLI edges


def test_eval_env_options_nested_too_deeply_is_one_error_line(tmp_path, capsys):
    """Defect 6: ``tether eval --env-options "[[[[..."`` was a RecursionError traceback (eval parsed it with
    yaml.safe_load); a duplicate key in it is refused too."""
    for value, needle in (("[" * 20_000, "nested too deeply"), ("{a: 1, a: 2}", "duplicate key 'a'")):
        rc, _, err = cli(capsys, "eval", "--model", tmp_path / "nope", "--agent", "multi_turn", "--env", "calculator",
                         "--env-options", value, "--benchmarks", "arithmetic", "--out", tmp_path / "o")
        assert_clean_error(rc, err, "--env-options", needle, line_only=True)


@pytest.mark.parametrize("override, needle, absent", [
    ("train.async.transport.kind=tcp", "the remote transport", "<lambda>"),
    ("data.options={size: 1, size: 2}", "duplicate key 'size'", None),
])
def test_config_edges_are_plain_lines(override, needle, absent, capsys):
    """Weaker edges: a wrong transport kind leaked pydantic internals ("found using <lambda>()"); a duplicate key in
    an override's value was silently dropped."""
    rc, _, err = cli(capsys, "config", "train.async=1", override)
    line = assert_clean_error(rc, err, needle, line_only=True)
    assert absent is None or absent not in line


def test_validation_errors_say_got_once_and_name_a_kind_plainly():
    """Weaker edges: a bad port printed "(got X)" twice (the validator's message named it, and the line added it
    again); a wrong kind of a union discriminated by a callable leaked pydantic's "found using <lambda>()". Both
    lines are built by tether.sections.validation_problems, for every section."""
    from typing import Annotated, Literal, Union

    from pydantic import BaseModel, Discriminator, Tag, ValidationError, field_validator

    from tether.sections import validation_problems

    class A(BaseModel):
        kind: Literal["a"] = "a"
        port: str = ""

        @field_validator("port")
        @classmethod
        def _port(cls, v):
            raise ValueError(f"must be HOST:PORT, got {v!r}")

    class B(BaseModel):
        kind: Literal["b"] = "b"

    class Outer(BaseModel):
        x: Annotated[Union[Annotated[A, Tag("a")], Annotated[B, Tag("b")]],
                     Discriminator(lambda v: v.get("kind") if isinstance(v, dict) else v.kind)] = A()

    with pytest.raises(ValidationError) as e:
        Outer(x={"kind": "a", "port": "1.2.3.4:99999"})
    (line,) = validation_problems(e.value, "section", "x")
    assert line.count("got ") == 1 and "1.2.3.4:99999" in line, line
    with pytest.raises(ValidationError) as e:
        Outer(x={"kind": "tcp"})
    (line,) = validation_problems(e.value, "section", "x")
    assert line == "section: unknown kind 'tcp'; expected one of: 'a', 'b'", line

def test_skyrl_gym_options_of_the_wrong_type_name_the_key(capsys):
    """Weaker edge: ``{extras: [1, 2], stop: 5}`` said only "'int' object is not iterable"."""
    pytest.importorskip("skyrl_gym")
    from tether.envs.skyrl_gym import SkyRLGymEnv
    from tether.errors import ConfigError

    for kwargs, needle in (({"stop": 5}, "options.stop must be a list"), ({"extras": [1, 2]}, "options.extras must be "
                                                                                               "a mapping")):
        with pytest.raises(ConfigError, match=needle):
            SkyRLGymEnv("gsm8k", **kwargs)


def test_demos_help_names_the_nested_keys():
    r = run_module("demos", "--help")
    assert r.returncode == 0 and "search." not in r.stdout.replace("\n", " ").replace("  ", " ")
    assert "rollout.agent.env.retriever.topk" in " ".join(r.stdout.split())


# ---------------------------------------------------------------- the organism's cache


MINI = OrganismSpec(hidden_size=16, layers=1, heads=2, steps=3, choice_steps=2, batch_size=32, context=96)


def _fake_build(monkeypatch):
    """The build's two heavy steps replaced by writing their outputs (the rest of `_build` runs as it is)."""
    monkeypatch.setattr(organism_build, "_write_base", lambda spec, path: path.mkdir())

    def tether(args, log, progress=None, total=0):
        if args[0] == "sft":
            Path(args[args.index("--output-dir") + 1]).mkdir()
        else:  # export
            out = Path(args[2])
            out.mkdir()
            (out / "model.safetensors").write_bytes(b"weights" * 100)
            (out / "config.json").write_text("{}")

    monkeypatch.setattr(organism_build, "_tether", tether)


def test_a_cache_entry_without_its_manifest_is_moved_aside(tmp_path, monkeypatch):
    """Defect 7: an organism directory without organism.json failed with a raw "Directory not empty" at the final
    rename, after the whole build, and again on every retry. Now it is moved aside (kept) before the build, and
    stale temporaries of a killed build are removed under the lock."""
    _fake_build(monkeypatch)
    final = organism_build.organism_path(MINI, tmp_path)
    final.mkdir(parents=True)
    (final / "something.txt").write_text("left by something else")
    stale = tmp_path / f".{final.name}.tmp-dead"
    (stale / "base").mkdir(parents=True)
    logs = []
    assert organism_build.build_organism(MINI, tmp_path, log=logs.append) == final
    assert (final / "organism.json").is_file() and not stale.exists()
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(f"{final.name}.damaged-")]
    assert len(aside) == 1 and (aside[0] / "something.txt").read_text() == "left by something else"
    assert any("moved aside" in m for m in logs)


def test_a_damaged_cached_organism_says_what_to_do(tmp_path, monkeypatch):
    """Weaker edge: a cached organism was trusted on organism.json alone; a truncated model.safetensors failed every
    run with an error that did not say to delete the directory. The build records each file's hash."""
    _fake_build(monkeypatch)
    final = organism_build.build_organism(MINI, tmp_path, log=lambda m: None)
    assert organism_build.build_organism(MINI, tmp_path, log=lambda m: None) == final  # intact: reused
    with open(final / "model.safetensors", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ModelLoadError, match=r"model.safetensors: 10 bytes, the build wrote 700.*rm -r"):
        organism_build.build_organism(MINI, tmp_path, log=lambda m: None)


def test_a_killed_build_takes_its_sft_child_with_it(tmp_path):
    """Weaker edge: kill -9 of a build orphaned its ``tether sft`` child, which kept every core busy. The build's
    children now get SIGKILL when it dies (PR_SET_PDEATHSIG), as a sweep's runs do."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    fake = tmp_path / "python"  # what the build runs as `python -m tether sft ...`: a long sleep, its pid printed
    fake.write_text(f"#!/bin/sh\necho $$ > {tmp_path / 'child.pid'}\nexec sleep 120\n")
    fake.chmod(0o755)
    code = ("import sys; from tether.organism import build as b; sys.executable = sys.argv[1]; "
            "b._tether(['sft'], print)")
    parent = subprocess.Popen([sys.executable, "-c", code, str(fake)], env=subprocess_env())
    try:
        deadline = time.time() + 60
        while not (tmp_path / "child.pid").is_file() or not (tmp_path / "child.pid").read_text().strip():
            assert time.time() < deadline and parent.poll() is None
            time.sleep(0.1)
        child = int((tmp_path / "child.pid").read_text())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.time() + 10
        while Path(f"/proc/{child}").exists() and "Z" not in _state(child):
            assert time.time() < deadline, "the build's child outlived it"
            time.sleep(0.1)
    finally:
        parent.kill()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0]
    except OSError:
        return "Z"


# ---------------------------------------------------------------- the reward worker of a killed run


SLOW_REWARD = "import time\n\ndef slow(completion, example):\n    time.sleep(0.5)\n    return 1.0\n"


def test_a_killed_trainer_leaves_no_traceback_from_its_reward_worker(tmp_path):
    """Weaker edge: the reward worker of a killed run wrote a BrokenPipeError traceback into seed-N.err."""
    (tmp_path / "slowrew.py").write_text(SLOW_REWARD)
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from tether.tasks.reward_worker import RewardWorker; "
            "from tether.tasks.base import Example; w = RewardWorker('slowrew:slow', timeout=60); "
            "print('ready', flush=True); w.score(['a'] * 20, [Example(id='e', prompt='p', answer='1')] * 20)")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=subprocess_env(), text=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(1.0)  # the worker is scoring
    os.kill(p.pid, signal.SIGKILL)
    _, err = p.communicate(timeout=60)  # ends when the worker, which shares the pipe, has exited too
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_a_reader_that_stops_early_gets_no_traceback(spec, tmp_path):
    """``tether sweep SPEC --dry-run | head -1``: the pipe closes under tether, which stops quietly (exit 0). A
    thousand seeds: more lines than a pipe buffers, so tether is still writing when its reader has gone."""
    many = yaml.safe_load(spec.read_text()) | {"seeds": 1000}
    spec.write_text(yaml.safe_dump(many))
    p = subprocess.Popen([sys.executable, "-m", "tether", "sweep", str(spec), "--out", str(tmp_path / "s"),
                          "--dry-run"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env())
    p.stdout.readline()
    p.stdout.close()  # the reader goes away before tether has printed every run
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err
