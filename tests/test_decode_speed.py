"""bench/decode_speed.py runs end to end on the tiny model and prints its A/B table and ratio."""

from __future__ import annotations

import re


def test_decode_speed_quick(bench_script, tiny_model_dir, tmp_path, capsys):
    mod = bench_script("decode_speed")
    assert mod.main(["--quick", "--model", str(tiny_model_dir), "--prompts", "2", "--n", "2",
                     "--max-new-tokens", "6", "--data-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "synthetic arithmetic prompts" in out  # no gsm8k file in tmp_path
    for sampler, kv in mod.CONFIGS:
        assert re.search(rf"sampler={sampler}\s+kv_cache={kv}\s+[\d.]+ s", out)
    assert re.search(r"ratio decode time tether\(inverse_cdf\+growing\)/transformers\(multinomial\+DynamicCache\) = "
                     r"\d+\.\d\d", out)
