"""bench/padding.py: the three splits' padding on a hand-made batch (checked by hand), and the script end to
end on the tiny model (the arithmetic default's rollout, its table)."""

from __future__ import annotations

import pytest

from test_microbatch_tokens import hand_batch


@pytest.fixture(scope="module")
def padding(bench_script):
    return bench_script("padding")


def test_rows_tokens_and_packed_padding_by_hand(padding):
    # 4 rows, prompts 2 each, responses 1, 1, 7, 7: real 4 * 2 + 16 = 24 tokens
    rb = hand_batch([2, 2, 2, 2], [1, 7, 1, 7])
    rows, tokens, packed = padding.splits(rb, 2, 0, False)
    # rows of 2 after sorting by length: (3, 3) and (9, 9): forwarded 2 * 3 + 2 * 9 = 24 = real: no padding
    assert (rows["micro_batches"], rows["forwarded"], rows["largest"], rows["pad_frac"]) == (2, 24, 18, 0.0)
    assert tokens["budget"] == packed["budget"] == 18  # the rows split's largest micro-batch
    assert (tokens["micro_batches"], tokens["forwarded"]) == (2, 24)  # (3, 3, 9) would be 27 > 18
    # packed, budget 18: 3 + 3 + 9 = 15 fits, then 9: forwarded = real
    assert (packed["micro_batches"], packed["forwarded"], packed["pad_frac"]) == (2, 24, 0.0)
    unsorted = hand_batch([2, 2, 2, 2], [1, 7, 1, 7], P=2, T=7)
    rows, _, _ = padding.splits(unsorted, 4, 0, False)  # one micro-batch of 4 rows, padded to 9 each: 36
    assert (rows["forwarded"], rows["pad_frac"]) == (36, pytest.approx(1 - 24 / 36))
    text = padding.table(padding.splits(unsorted, 4, 12, False))
    assert "| rows | - | 1 | 36 | 36 | 24 | 0.333 | 1.00x |" in text and "| packed | 12 |" in text


def test_bench_padding_runs_end_to_end(padding, tiny_model_dir, capsys, one_thread):
    assert padding.main(["--model", str(tiny_model_dir), "--tasks", "arithmetic", "--prompts", "2",
                         "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "### arithmetic: 2 prompts x" in out and "| rows | - |" in out and "| packed |" in out
