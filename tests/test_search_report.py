"""bench/search_report.py's pooled seeds: the EM per seed, the mean, and paired differences with the
question-clustered s.e. (evaluation noise) beside the across-seed s.e. (seed i of one recipe against seed i of
another; a single base repeated)."""

from __future__ import annotations

import math

import pytest


@pytest.fixture(scope="module")
def report(bench_script):
    return bench_script("search_report")


def test_seeds_are_pooled_and_paired_by_question(report):
    record = {"id": ["q1", "q2", "q3", "q4"],
              "em": {"sft": [0, 0, 1, 0], "a0": [1, 0, 1, 0], "a1": [1, 1, 1, 0],
                     "b0": [0, 0, 1, 0], "b1": [0, 0, 0, 0]}}
    text = report.seeds_table(record, {"a": ["a0", "a1"], "b": ["b0", "b1"]}, "sft")
    a_row = next(ln for ln in text.splitlines() if ln.startswith("| a |"))
    b_row = next(ln for ln in text.splitlines() if ln.startswith("| b |"))
    assert "| 2 | 50.0, 75.0 | 62.5 |" in a_row and "| 2 | 25.0, 0.0 | 12.5 |" in b_row
    # a vs sft: differences per (seed, question): seed 0 [1,0,0,0], seed 1 [1,1,0,0]; mean 3/8. Clusters by
    # question: q1 sum 2, q2 1, q3 0, q4 0 -> centred (2-0.75, 1-0.75, -0.75, -0.75); se = sqrt(4/3 * sum sq) / 8
    sums = [2 - 2 * 3 / 8, 1 - 2 * 3 / 8, -2 * 3 / 8, -2 * 3 / 8]
    se = math.sqrt(4 / 3 * sum(v * v for v in sums)) / 8
    # across seeds (the error of a training effect): the seeds' differences 50 - 25 and 75 - 25, sd / sqrt(2) = 12.5
    assert f"+37.5 (across seeds 12.5; evaluation noise {100 * se:.1f})" in a_row
    assert "-50.0 (across seeds 25.0; evaluation noise" in b_row  # b minus a: 12.5 - 62.5; seeds -25 and -75
    with pytest.raises(SystemExit, match="--seeds c: zz not among --evals"):
        report.seeds_table(record, {"c": ["zz"]}, "sft")
    assert "unequal seeds" in report.seeds_table(record, {"a": ["a0", "a1"], "b": ["b0"]}, "sft")
