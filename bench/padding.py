"""The padding fraction of the update's micro-batches, before and after train.micro_batch_tokens and
train.packing, on one real rollout batch of a task (the arithmetic default, the search agent).

One rollout of ``--prompts`` x the recipe's samples is generated with the embedded default run's settings
(``tether train``'s config for the task, the model ``--model``), then cut three ways by the trainer's own
`tether.passes.micro_batches` and measured by `tether.passes.forwarded_positions` (what the ``pad_frac``
metric sums during training):

* ``rows``: ``train.micro_batch_size`` rows at a time (the default 8), each padded to its longest;
* ``tokens``: ``train.micro_batch_tokens`` = ``--tokens`` (default: the largest forwarded size among the rows
  split's micro-batches, so the peak activation memory stays that of ``rows``), rows sorted by length;
* ``packed``: the same budget with ``train.packing`` (sequences one after another, no padding).

pad_frac = 1 - real tokens / forwarded positions, over the whole batch. Prints one table per task and the
ratio of forwarded positions (the forward's work) of each split to ``rows``'.

Usage::

    python bench/padding.py                                # arithmetic default and search agent, SmolLM2
    python bench/padding.py --tasks arithmetic --prompts 8
    python bench/padding.py --model /path/to/tiny --tasks arithmetic --prompts 2 --max-new-tokens 8  # plumbing
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchutil import machine_info  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--tasks", default="arithmetic,search", help="comma-separated: arithmetic (the default run's "
                   "task) and/or search (the closed-pool search agent; needs the shared search data)")
    p.add_argument("--prompts", type=int, default=0, help="prompts in the batch (default 0: the task's default "
                   "rollout.prompts_per_step)")
    p.add_argument("--max-new-tokens", type=int, default=0, help="tokens per response or turn (default 0: the "
                   "task's default)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="rows per micro-batch of the rows split (8)")
    p.add_argument("--tokens", type=int, default=0, help="token budget of the tokens and packed splits (default 0: "
                   "the rows split's largest micro-batch, in forwarded positions)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    a = p.parse_args(argv)
    a.tasks = [t.strip() for t in a.tasks.split(",") if t.strip()]
    if not a.tasks or any(t not in ("arithmetic", "search") for t in a.tasks):
        p.error(f"--tasks: arithmetic and/or search, got {a.tasks}")
    return a


def splits(rb, size: int, tokens: int, share_prompt: bool) -> list[dict]:
    """The three splits of rollout batch ``rb``: name, budget, micro-batches, forwarded positions, the largest
    micro-batch's, real tokens and pad_frac each."""
    from tether.passes import forwarded_positions, micro_batches

    idx = list(range(len(rb)))
    real = int(rb.prompt_mask.sum() + rb.response_mask.sum())

    def measure(name: str, micro: list, packed: bool, budget: int) -> dict:
        fwd = [int(forwarded_positions(rb, m, packed)) for m in micro]
        return dict(split=name, budget=budget, micro_batches=len(micro), forwarded=sum(fwd), largest=max(fwd),
                    real=real, pad_frac=1 - real / sum(fwd))

    rows = measure("rows", micro_batches(rb, idx, size, share_prompt), False, 0)
    budget = tokens or rows["largest"]
    return [rows,
            measure("tokens", micro_batches(rb, idx, size, share_prompt, budget, False), False, budget),
            measure("packed", micro_batches(rb, idx, size, share_prompt, budget, True), True, budget)]


def table(results: list[dict]) -> str:
    lines = ["| split | token budget | micro-batches | forwarded positions | largest micro-batch | real tokens | "
             "pad_frac | forwarded / rows' |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = results[0]["forwarded"]
    for r in results:
        lines.append(f"| {r['split']} | {r['budget'] or '-'} | {r['micro_batches']} | {r['forwarded']} | "
                     f"{r['largest']} | {r['real']} | {r['pad_frac']:.3f} | {r['forwarded'] / base:.2f}x |")
    return "\n".join(lines)


def rollout(a, task: str, out: Path):
    """One rollout batch of ``task`` with the default run's settings; returns it and the config."""
    from tether.resolve import load_config
    from tether.train import build_trainer

    over = {"model.name": a.model, "run.progress": False, "run.plot": False, "train.seed": a.seed,
            "eval.before": False, "eval.after": False}
    if a.prompts:
        over["rollout.prompts_per_step"] = a.prompts
    if a.max_new_tokens:
        over["rollout.max_new_tokens"] = a.max_new_tokens
    cfg = load_config(None, over, task="search" if task == "search" else None)
    t = build_trainer(cfg, out / task, log=lambda *x: None)
    try:
        examples = t.data.take(cfg.rollout.prompts_per_step)
        return t.agent.rollout(examples, t._sampling(0)), cfg
    finally:
        t.close()


def main(argv=None) -> int:
    a = parse_args(argv)
    print(machine_info())
    with tempfile.TemporaryDirectory() as tmp:
        for task in a.tasks:
            rb, cfg = rollout(a, task, Path(tmp))
            P, n = cfg.rollout.prompts_per_step, cfg.rollout.n
            print(f"\n### {task}: {P} prompts x {n} samples, {cfg.rollout.max_new_tokens} tokens a "
                  f"{'turn' if task == 'search' else 'response'}, share_prompt={cfg.train.share_prompt}\n")
            print(table(splits(rb, a.micro_batch_size, a.tokens, cfg.train.share_prompt)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
