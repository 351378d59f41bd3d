"""Faults of a probe (issue #37) in what tether reads and writes, through the real CLI (``python -m tether`` in a
subprocess): JSON and YAML nested deeper than their parsers recurse, `tether demos` onto a full or read-only
filesystem or over a file of yours, a damaged checkpoint in the list of available ones, tether's own lock among
the entries an ``--overwrite`` refusal names.

Each case ends as one ``tether: error:`` line naming the file (and row) and exit code 2 (tests/test_errors.py),
with nothing written. Cases that fail before any model loads run ``tether.cli.main`` in this process (the same
code path, seconds faster)."""

from __future__ import annotations

import builtins
import errno
import json
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import DIGITS, assert_clean_error, cli_args, subprocess_env
from tether.cli import main

pytestmark = pytest.mark.faults


def cli(capsys, *args):
    """``tether ARGS`` in this process: (exit code, stdout, stderr)."""
    rc = main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ---------------------------------------------------------------- JSON and YAML nested too deeply


def _deep_jsonl(path):
    """A JSONL file whose row 2 (line 3, after a blank line) is nested 100,000 deep (the JSON parser recurses once per
    level)."""
    path.write_text('\n\n{"prompt": ' + "[" * 100_000 + "\n")
    return path


DEEP_LOADERS = {  # the command reading the file given as {f}; {t}: the test's directory
    "sft --data": ["sft", "--data", "{f}", "--model", "{t}/nope", "--output-dir", "{t}/run"],
    "train data.task=": ["train", "data.task={f}", "--model", "{t}/nope", "--output-dir", "{t}/run"],
    # a held-out set loads with the cheap checks: before the run directory and the model ({t}/nope is never read)
    "train eval.benchmarks=": ["train", "eval.benchmarks={f}", "--model", "{t}/nope", "--output-dir", "{t}/run"],
    "eval --benchmarks": ["eval", "--model", "{t}/nope", "--benchmarks", "{f}", "--out", "{t}/run"],
    "demos --data": ["demos", "calculator", "--data", "{f}", "--out", "{t}/run"],
    "retrieve serve --corpus": ["retrieve", "serve", "--corpus", "{f}", "--port", "0", "--cache-dir", "{t}/run"],
}


@pytest.mark.parametrize("command", list(DEEP_LOADERS))
def test_a_row_nested_too_deeply_is_one_error_line(command, tmp_path, capsys):
    """A JSONL row nested 100,000 deep was a RecursionError traceback in every loader (tasks/files.py caught only
    JSONDecodeError)."""
    f = _deep_jsonl(tmp_path / "deep.jsonl")
    argv = [a.format(f=f, t=tmp_path) for a in DEEP_LOADERS[command]]
    rc, _, err = cli(capsys, *argv)
    assert_clean_error(rc, err, f"{f} line 3", "nested too deeply", line_only=True)
    assert not (tmp_path / "run").exists()


def test_a_json_file_nested_too_deeply_is_one_error_line(tmp_path, capsys):
    """The same for a .json data file (a list of rows)."""
    f = tmp_path / "deep.json"
    f.write_text("[" * 100_000)
    rc, _, err = cli(capsys, "eval", "--model", tmp_path / "nope", "--benchmarks", f)
    assert_clean_error(rc, err, str(f), "nested too deeply", line_only=True)


def test_a_config_nested_too_deeply_is_one_error_line(tmp_path, capsys):
    """`train: [[[...` 20,000 deep was a RecursionError traceback in config/yaml_io.py, for `tether config`,
    `train --config` and `sft --config`; an override value the same (config/overrides.py)."""
    f = tmp_path / "deep.yaml"
    f.write_text("train: " + "[" * 20_000 + "\n")
    run = tmp_path / "run"
    for argv in (["config", "--config", f], ["train", "--config", f, "--model", tmp_path / "nope", "--output-dir", run],
                 ["sft", "--config", f, "--model", tmp_path / "nope", "--output-dir", run]):
        rc, out, err = cli(capsys, *argv)
        assert_clean_error(rc, err, f"config file {f}", "nested too deeply", line_only=True)
        assert out == ""
    assert not run.exists()
    rc, _, err = cli(capsys, "config", "train.steps=" + "[" * 20_000)
    assert_clean_error(rc, err, "train.steps", "nested too deeply", line_only=True)
    rc, _, err = cli(capsys, "config", "train.steps=[")
    assert_clean_error(rc, err, "train.steps", "not a valid YAML value", line_only=True)


# ---------------------------------------------------------------- tether demos --out


def _demos(capsys, out, *extra):
    return cli(capsys, "demos", "calculator", "--limit", "5", "--out", out, *extra)


def test_demos_onto_a_full_disk_is_one_error_line(tmp_path):
    """A real write failure, not a mock: a file-size limit (EFBIG, as a full disk or quota ends a write). It was an
    OSError traceback; now one line naming the file, and neither it nor a temporary file is left."""
    out = tmp_path / "demos.jsonl"
    code = ("import resource, sys; from tether.cli import main; "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000)); sys.exit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "demos", "calculator", "--limit", "50", "--out", str(out)],
                       capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert_clean_error(r.returncode, r.stderr, f"cannot write {out}", "File too large", line_only=True)
    assert list(tmp_path.iterdir()) == []


def test_demos_onto_a_read_only_filesystem_is_one_error_line(tmp_path, monkeypatch, capsys):
    """Read-only as the kernel reports it (EROFS on creating the file; injected, since root writes anyway), and a
    real one: /proc."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real_open = builtins.open

    def open_(file, mode="r", *a, **k):
        if str(file).startswith(str(ro)) and any(c in mode for c in "wax"):
            raise OSError(errno.EROFS, "Read-only file system", str(file))
        return real_open(file, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", open_)
    outs = [ro / "demos.jsonl"] + ([Path("/proc/tether-test-demos.jsonl")] if Path("/proc/self").is_dir() else [])
    for out, why in zip(outs, ["Read-only file system", ""]):
        rc, stdout, err = _demos(capsys, out)
        assert_clean_error(rc, err, f"cannot write {out}", why, line_only=True)
        assert stdout == ""
    assert list(ro.iterdir()) == []


def test_demos_overwrite_replaces_only_a_file_tether_wrote(tmp_path, capsys):
    """`tether demos --overwrite` replaced a file of yours. The rule of docs/reliability.md: --overwrite deletes only
    what tether wrote; every row tether demos writes carries its mark, and a file is replaced only if all do."""
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"messages": [{"role": "user", "content": "my own"}]}\n')
    before = mine.read_bytes()
    rc, _, err = _demos(capsys, mine, "--overwrite")
    assert_clean_error(rc, err, str(mine), "not written by tether demos", "line 1", line_only=True)
    assert mine.read_bytes() == before
    out = tmp_path / "demos.jsonl"
    assert _demos(capsys, out)[0] == 0
    first = out.read_bytes()
    assert all(json.loads(ln)["tether"] == "demos" for ln in first.splitlines())
    assert _demos(capsys, out, "--overwrite", "--seed", "1")[0] == 0  # tether's own file: replaced
    assert out.read_bytes() != first
    with open(out, "a") as f:  # a row of yours appended to tether's file
        f.write('{"prompt": "mine", "completion": "too"}\n')
    before = out.read_bytes()
    rc, _, err = _demos(capsys, out, "--overwrite")
    assert_clean_error(rc, err, str(out), "line 6", line_only=True)
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demos.jsonl", "mine.jsonl"]


# ---------------------------------------------------------------- run directories and checkpoints


@pytest.fixture(scope="module")
def work(make_workdir):
    return make_workdir("faults_inputs", DIGITS)


def test_train_overwrite_refusal_does_not_name_tethers_own_lock(work, tmp_path, capsys):
    """The refusal listed `.lock` (the lock this trainer had just taken) among the user's entries."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    rc, _, err = cli(capsys, *cli_args(work, tmp_path / "nope", mine, 1), "--overwrite")
    error = assert_clean_error(rc, err, str(mine), "(notes.txt)", "not written by tether", line_only=True)
    assert ".lock" not in error
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def _run_with_checkpoints(run: Path, steps) -> Path:
    """A run directory holding checkpoints of a one-layer model at ``steps`` (all a checkpoint listing reads)."""
    import torch

    from tether.rundir.checkpoint import save_checkpoint

    run.mkdir()
    (run / "config.yaml").write_text("recipe: grpo\n")
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    for s in steps:
        save_checkpoint(run, s, model, None, opt, None, {}, keep=len(steps))
    return run


def test_a_damaged_checkpoint_is_not_listed_as_available(tmp_path, capsys):
    """`export --step 3` of a damaged step 3 said "available: 2, 3"; a missing step listed it too. Now the list
    holds the checkpoints that verify, and names the damaged one as such."""
    run = _run_with_checkpoints(tmp_path / "run", [2, 3])
    f = run / "checkpoints" / "step-000003" / "policy.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0xFF
    f.write_bytes(bytes(data))
    for step in ("3", "5"):
        rc, _, err = cli(capsys, "export", run, tmp_path / "out", "--step", step)
        error = assert_clean_error(rc, err, "available", "2; damaged: 3", line_only=True)
        assert "2, 3" not in error
    assert not (tmp_path / "out").exists()
