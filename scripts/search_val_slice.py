"""The validation slice of the search cold start: train questions to choose RL settings on, never dev.

    python scripts/search_val_slice.py --demos runs/coldstart/demos_search.jsonl \
        --out runs/coldstart/val/val_slice.jsonl

It keeps, in file order, the first ``--limit`` rows of the ``multihop`` train file (the search data dir,
``$TETHER_SEARCH_DATA_DIR``) whose question is in no SFT demonstration (``--demos``: the SFT model was trained
on those answers) and is none of the prompts an RL run of ``--seeds`` takes in ``--prompts`` prompts (the
trainer's own `tether.tasks.stream.PromptStream` order: 5 steps x 4 prompts by default). The rows are copied
verbatim, so ``tether eval --benchmarks <out>`` scores them like ``multihop_dev``. It prints what it excluded.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from tether.search.data import SEARCH_DATASETS, search_data_dir
from tether.tasks.stream import PromptStream

_QUESTION = re.compile(r"\nQuestion: (.*)\n", re.S)


def demo_questions(path: Path) -> set[str]:
    """The question of each demonstration (its first user turn, as the search prompt writes it)."""
    out = set()
    for lineno, line in enumerate(path.open(encoding="utf-8"), 1):
        if not line.strip():
            continue
        user = next((m["content"] for m in json.loads(line)["messages"] if m["role"] == "user"), "")
        m = _QUESTION.search(user)
        if m is None:
            sys.exit(f"search_val_slice: error: {path} line {lineno}: no 'Question: ...' line in the first user turn")
        out.add(m.group(1).strip())
    return out


def rl_prompt_rows(n_rows: int, seeds: list[int], prompts: int) -> set[int]:
    """Row indices the trainer's prompt stream gives in its first ``prompts`` takes, for each seed."""
    rows = set()
    for seed in seeds:
        stream = PromptStream(examples=list(range(n_rows)), reward_name="search", seed=seed)
        rows.update(stream.take(prompts))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demos", type=Path, required=True, help="the SFT demonstrations (tether demos search)")
    p.add_argument("--out", type=Path, required=True, help="the JSONL slice to write")
    p.add_argument("--train", type=Path, default=None, help="the train file (default: multihop of the data dir)")
    p.add_argument("--limit", type=int, default=200, help="rows to keep")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="RL seeds whose prompts are excluded")
    p.add_argument("--prompts", type=int, default=20, help="prompts an RL run takes (steps x prompts a step)")
    a = p.parse_args(argv)
    train = a.train or (search_data_dir() or Path(".")) / SEARCH_DATASETS["multihop"].file
    lines = [ln for ln in train.read_text(encoding="utf-8").splitlines() if ln.strip()]
    seen = demo_questions(a.demos)
    rl = rl_prompt_rows(len(lines), a.seeds, a.prompts)
    keep, n_demo, n_rl = [], 0, 0
    for i, line in enumerate(lines):
        q = json.loads(line)["question"].strip()
        if q in seen:
            n_demo += 1
        elif i in rl:
            n_rl += 1
        else:
            keep.append(line)
    if len(keep) < a.limit:
        sys.exit(f"search_val_slice: error: only {len(keep)} rows of {train} are left, --limit is {a.limit}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("\n".join(keep[:a.limit]) + "\n", encoding="utf-8")
    print(f"{a.out}: {a.limit} of {len(lines)} train rows ({n_demo} excluded as SFT demonstrations, "
          f"{n_rl} more as RL prompts of seeds {a.seeds}, {len(keep) - a.limit} left unused)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
