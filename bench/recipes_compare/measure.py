"""What is measured: the held-out sets and their greedy evaluation, and on the final policy's own
temperature-1 samples the exact KL to the initial model (tether's ``exact_kl_sample``) and the entropy."""

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
    """Greedy avg@1 and friends on the held-out set (the library's evaluate(), with the single-turn
    agent on a transformers engine of ``--eval-batch-size`` sequences, no system prompt)."""
    from tether.agents import make_agent
    from tether.config import RolloutConfig
    from tether.eval import EvalSettings, evaluate
    from tether.rollout import make_engine
    engine = make_engine(RolloutConfig(batch_size=a.eval_batch_size), model, tok, show_progress=False)
    settings = EvalSettings(n=1, greedy=True, temperature=0.0, max_new_tokens=a.eval_max_new_tokens[task],
                            batch_size=a.eval_batch_size, seed=0)
    res = evaluate(make_agent("single_turn", engine, tok), examples, reward_fn, settings, show_progress=a.progress,
                   desc=f"eval {task}")
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
    every response token of the rollout batch ``rb``; returns token means and the token count.

    The KL is tether's own diagnostic, ``tether.passes.exact_kl_sample``: the initial model becomes a
    fixed ``tether.anchor.Anchor`` (a copy of its weights, swapped into ``policy`` for the anchor's
    pass), both go through ``tether.logprobs.response_stats`` at temperature 1 with every vocabulary id
    gathered, and ``KL_t = sum_v p_t(v) (log p_t(v) - log q_t(v))`` is averaged over the response
    tokens. It runs on ``micro`` responses at a time, so only [micro, T, V] log-probs exist at once,
    and each micro-batch's token mean is weighted by its token count (the same token mean over all of
    ``rb``). ``exact_kl_sample`` sums in float32 where this script's own copy summed in float64; the
    log-probs themselves are float32 either way (the models run in fp32), and the two agree to ~1e-6
    relative (test_compare_recipes checks it against a float64 full-logits computation). The entropy,
    ``H_t = -sum_v p_t(v) log p_t(v)``, is ``response_stats``'s, from one more pass of the policy.
    """
    import torch

    from tether.anchor import Anchor
    from tether.config.anchor import FixedAnchorConfig
    from tether.logprobs import response_stats
    from tether.passes import exact_kl_sample

    anchor = Anchor(FixedAnchorConfig(), initial)  # theta_0, the initial model's weights
    kl_sum, ent_sum, n_tok = 0.0, 0.0, 0
    mode = policy.training
    policy.eval()
    try:
        with torch.no_grad():
            for s in range(0, len(rb), micro):
                mb = rb.select(list(range(s, min(s + micro, len(rb)))))
                n = int(mb.response_mask.sum())
                if n == 0:
                    continue
                kl = exact_kl_sample(policy, anchor, mb, len(mb), temperature=1.0, chunk_size=chunk_size,
                                     share_prompt=True)
                ent = response_stats(policy, mb.prompt_ids, mb.prompt_mask, mb.response_ids, mb.response_mask,
                                     temperature=1.0, entropy=True, chunk_size=chunk_size).entropy
                kl_sum += kl * n
                ent_sum += float(ent.double()[mb.response_mask].sum())
                n_tok += n
    finally:
        policy.train(mode)
        del anchor
    return {"kl_to_initial": kl_sum / max(n_tok, 1), "entropy": ent_sum / max(n_tok, 1), "kl_tokens": n_tok}


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

