"""What is measured: the held-out sets and their greedy evaluation, and on the final policy's own
temperature-1 samples the exact KL to the initial model and the entropy."""

from __future__ import annotations

import json
import time
from pathlib import Path


def check_data_dir(a) -> None:
    """Fail early, before any model is loaded, if GSM8K is asked for and its files are missing."""
    if "gsm8k" not in a.tasks:
        return
    d = Path(a.data_dir)
    missing = [n for n in ("gsm8k_train.jsonl", "gsm8k_test.jsonl") if not (d / n).is_file()]
    if missing:
        raise SystemExit(f"[compare] the data directory {d} lacks {', '.join(missing)}: the gsm8k task trains on "
                         f"GSM8K train and evaluates on GSM8K test. Pass --data-dir DIR (or set $TETHER_DATA_DIR) "
                         f"to a directory holding both files, or leave gsm8k out with --tasks arithmetic")


def eval_set(a, task: str):
    """(examples, reward function, description) of a task's held-out set; the same for every run."""
    from tether.tasks.arithmetic import ArithmeticTask
    from tether.tasks.benchmarks import load_benchmark
    from tether.tasks.rewards import load_reward
    if task == "arithmetic":
        ex = ArithmeticTask(seed=0, difficulty=a.difficulty, split="test").examples(a.eval_limit_synthetic)
        distinct = len({content_of(task, e) for e in ex})
        desc = (f"synthetic arithmetic, held-out split (content buckets never trained on), difficulty "
                f"{a.difficulty}, the first {len(ex)} problems of the seed-0 test stream ({distinct} distinct "
                f"start/operation contents)")
        return ex, load_reward("arithmetic"), desc
    b = load_benchmark("gsm8k", limit=a.eval_limit_gsm8k, data_dir=a.data_dir)
    if b.split != "test":
        raise RuntimeError(f"GSM8K evaluation must use the test split, got {b.split!r}")
    return b.examples, b.reward_fn, f"GSM8K test, the first {len(b.examples)} problems (training uses GSM8K train)"



def run_eval(model, tok, examples, reward_fn, a, task: str) -> dict:
    """Greedy avg@1 and friends on the held-out set (the library's evaluate())."""
    from tether.eval import evaluate
    res = evaluate(model, tok, examples, reward_fn, n=1, greedy=True, temperature=0.0,
                   max_new_tokens=a.eval_max_new_tokens[task], batch_size=a.eval_batch_size, seed=0,
                   show_progress=a.progress, desc=f"eval {task}")
    keep = ("avg@1", "mean_response_tokens", "truncation_rate", "no_answer_rate", "n_problems", "gen_tokens",
            "wall_time_s", "reward_errors")
    out = {k: float(res.metrics[k]) for k in keep if k in res.metrics}
    out["correct"] = [int(p["n_correct"]) for p in res.per_problem]  # per problem, for clustered errors
    return out


def content_of(task: str, example) -> str:
    """What makes two held-out problems the same problem: the arithmetic content (start value and
    operations; the wording differs) or, for GSM8K, the problem itself."""
    if task == "arithmetic":
        return json.dumps([example.meta["start"], example.meta["ops"]])
    return str(example.id)



def token_kl_entropy(policy, initial, rb, *, micro: int = 2, chunk_size: int = 1024) -> dict:
    """Exact per-token KL(policy || initial) over the full vocabulary and the policy's entropy, at
    every response token of the rollout batch ``rb``; returns token means (and sums, counts).

    Both models go through ``tether.logprobs.response_stats`` with every vocabulary id as
    ``gather_ids`` (an expanded view, as in the trainer's ``_exact_kl_sample``), ``micro``
    responses at a time, so only [micro, T, V] log-probs exist at once:
    ``KL_t = sum_v p_t(v) (log p_t(v) - log q_t(v))``, ``H_t = -sum_v p_t(v) log p_t(v)``.
    """
    import torch

    from tether.logprobs import response_stats

    vocab = policy.get_output_embeddings().weight.shape[0]
    kl_sum, ent_sum, n_tok, kl_max = 0.0, 0.0, 0, 0.0
    modes = (policy.training, initial.training)
    policy.eval()
    initial.eval()
    try:
        with torch.no_grad():
            for s in range(0, len(rb), micro):
                mb = rb.select(list(range(s, min(s + micro, len(rb)))))
                if int(mb.response_mask.sum()) == 0:
                    continue
                every_id = torch.arange(vocab, device=mb.response_ids.device).expand(*mb.response_ids.shape, vocab)

                def stats(model, entropy):
                    return response_stats(model, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask,
                                          temperature=1.0, gather_ids=every_id, entropy=entropy,
                                          chunk_size=chunk_size)

                sp, s0 = stats(policy, True), stats(initial, False)
                lp, l0 = sp.ids_logp.double(), s0.ids_logp.double()  # [b, T, V] log-probs at every id
                kl = (lp.exp() * (lp - l0)).sum(-1)  # [b, T]
                m = mb.response_mask
                kl_sum += float(kl[m].sum())
                ent_sum += float(sp.entropy.double()[m].sum())
                n_tok += int(m.sum())
                kl_max = max(kl_max, float(kl[m].max()))
                del sp, s0, lp, l0, kl
    finally:
        policy.train(modes[0])
        initial.train(modes[1])
    return {"kl_to_initial": kl_sum / max(n_tok, 1), "entropy": ent_sum / max(n_tok, 1), "kl_token_max": kl_max,
            "kl_tokens": n_tok}


def kl_and_entropy(policy, initial, tok, examples, *, max_new_tokens: int, seed: int) -> dict:
    """:func:`token_kl_entropy` on one response per example sampled from ``policy`` at temperature 1
    (so the token mean estimates the expected per-token KL under the policy's own distribution)."""
    from tether.agents import make_agent
    from tether.config import RolloutConfig
    from tether.rollout import SamplingParams, make_engine

    t0 = time.perf_counter()
    agent = make_agent("single_turn", make_engine(RolloutConfig(batch_size=32), policy, tok), tok)
    rb = agent.rollout(examples, SamplingParams(n=1, temperature=1.0, max_new_tokens=max_new_tokens, seed=seed))
    out = token_kl_entropy(policy, initial, rb)
    out.update(kl_responses=len(rb), kl_mean_response_tokens=out["kl_tokens"] / max(len(rb), 1),
               kl_wall_s=time.perf_counter() - t0)
    return out

