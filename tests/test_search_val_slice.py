"""scripts/search_val_slice.py: the validation slice the search cold start's RL settings are chosen on holds
train rows only, none that an SFT demonstration answered and none an RL run of the listed seeds trains on;
rows are copied verbatim, in file order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tether.tasks.stream import PromptStream

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "search_val_slice.py"
PROMPT = "Answer the question below.\nQuestion: {q}\n"


def _write(tmp_path, n=30):
    rows = [{"id": f"r{i}", "question": f"Who is person {i}?", "golden_answers": [f"P{i}"]} for i in range(n)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    demos = tmp_path / "demos.jsonl"
    demo = [{"messages": [{"role": "user", "content": PROMPT.format(q=f"Who is person {i}?")},
                          {"role": "assistant", "content": f"<answer> P{i} </answer>"}]} for i in (1, 4, 9)]
    demos.write_text("".join(json.dumps(d) + "\n" for d in demo))
    return rows, train, demos


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True)


def test_slice_excludes_demonstrated_and_rl_prompted_rows(tmp_path):
    rows, train, demos = _write(tmp_path)
    out = tmp_path / "val.jsonl"
    r = _run("--demos", demos, "--train", train, "--out", out, "--limit", 10, "--seeds", 0, 1, "--prompts", 4)
    assert r.returncode == 0, r.stderr
    rl = set()
    for seed in (0, 1):
        rl.update(PromptStream(examples=list(range(30)), reward_name="search", seed=seed).take(4))
    expected = [i for i in range(30) if i not in {1, 4, 9} and i not in rl][:10]
    kept = [json.loads(line) for line in out.read_text().splitlines()]
    assert [k["id"] for k in kept] == [f"r{i}" for i in expected] and kept[0] == rows[expected[0]]
    assert "3 excluded as SFT demonstrations" in r.stdout


def test_too_few_rows_and_bad_demos_are_one_error_line(tmp_path):
    _, train, demos = _write(tmp_path, n=8)
    r = _run("--demos", demos, "--train", train, "--out", tmp_path / "v.jsonl", "--limit", 50)
    assert r.returncode != 0 and "--limit is 50" in r.stderr and not (tmp_path / "v.jsonl").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "no question here"}]}) + "\n")
    r = _run("--demos", bad, "--train", train, "--out", tmp_path / "v.jsonl")
    assert r.returncode != 0 and f"{bad} line 1" in r.stderr
