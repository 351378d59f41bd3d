"""Faults of a probe (issue #37) in what tether reads and writes, through the real CLI (``python -m tether`` in a
subprocess): JSON and YAML nested deeper than their parsers recurse, `tether demos` onto a full or read-only
filesystem or over a file of yours, a damaged checkpoint in the list of available ones, tether's own lock among
the entries an ``--overwrite`` refusal names.

Each case ends as one ``tether: error:`` line naming the file (and row) and exit code 2 (tests/test_errors.py),
with nothing written. Cases that fail before any model loads run ``tether.cli.main`` in this process (the same
code path, seconds faster)."""

from __future__ import annotations

import pytest

from helpers import assert_clean_error, run_module
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
