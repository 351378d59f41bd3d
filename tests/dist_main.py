"""Entry point of the multi-process tests (tests/test_distributed.py), run under torchrun or alone.

    dist_main.py train ARGS...   ``tether train`` with the scripted engine registered
    dist_main.py check MODEL_DIR the FSDP pitfalls on a tiny model (see ``check``)
"""

import sys

from tether.testing import register_scripted_engine

# at import, not under __main__: a rollout worker (train.async.max_staleness >= 1) is a spawned process that imports
# this module as __mp_main__ and builds its engine from the config, so it needs the name registered too
register_scripted_engine()


def check(model_dir: str) -> None:
    """On 2 ranks: generation with different lengths per rank, the anchor swap, stale weights, the
    log-prob head's gradient; each compared with an unsharded copy of the model."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tether import distributed as dist
    from tether.anchor import Anchor
    from tether.config.anchor import EMAAnchorConfig
    from tether.logprobs import response_stats
    from tether.rollout import SamplingParams
    from tether.rollout.hf import HFEngine

    assert dist.init() and dist.world_size() == 2
    r = dist.rank()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref = copy.deepcopy(model)
    dist.shard_model(model)
    assert dist.is_sharded(model)
    shards = [dist.local(p) for p in model.parameters()]  # as the optimizer holds them

    # 1. generation: rank 0 decodes 2 tokens, rank 1 16 tokens in 1-token segments (different
    #    numbers of forward calls); each equals the unsharded model's output.
    prompts = [tok.encode("Hello world"), tok.encode("What is 2 + 2?")]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=2 if r == 0 else 16, seed=11 + r)
    with dist.gathered(model):
        out = HFEngine(model, tok, prune_every=1).generate(prompts, params)
    want = HFEngine(ref, tok, prune_every=1).generate(prompts, params)
    assert torch.equal(out.response_ids, want.response_ids), (r, out.response_ids, want.response_ids)
    lengths = dist.all_gather_objects(out.response_ids.shape[1])
    print(f"[check] rank {r}: generated widths {lengths}", flush=True)

    ids = torch.tensor([tok.encode("The quick brown fox jumps")])
    logits = lambda m: m(input_ids=ids).logits  # noqa: E731

    # 2. anchor: snapshot, then edit the policy's shards (as an optimizer step would); applied()
    #    must give the snapshot's logits, and after it the edited ones (no stale gathered weights).
    anchor = Anchor(EMAAnchorConfig(eta=0.5, every=1), model)
    with torch.no_grad():
        logits(model)  # the root now holds gathered weights
        for s, q in zip(shards, ref.parameters()):
            s.mul_(1.5)
            q.mul_(1.5)
        dist.reshard(model)
    with torch.no_grad():
        edited = logits(model)
        assert torch.allclose(edited, logits(ref), atol=1e-5), "stale weights after editing the shards"
        orig = copy.deepcopy(ref)
        for q in orig.parameters():
            q.div_(1.5)
        with anchor.applied(model):
            assert torch.allclose(logits(model), logits(orig), atol=1e-5), "the anchor was not applied"
        assert torch.allclose(logits(model), edited, atol=1e-6), "the policy was not restored after the anchor"
        # EMA: theta_a <- 0.5 theta_a + 0.5 theta, then gathered whole tensors match the unsharded rule
        assert anchor.update(model, 1)
        full = anchor.tensors()
        for (n, q), q0 in zip(ref.named_parameters(), orig.parameters()):
            assert torch.allclose(full[n], 0.5 * q0 + 0.5 * q, atol=1e-6), n

    # 3. the chunked log-prob head multiplies by the (sharded) lm_head weight outside the forward
    resp = torch.tensor([tok.encode(" over the lazy dog")])
    pm, rm = torch.ones_like(ids, dtype=torch.bool), torch.ones_like(resp, dtype=torch.bool)
    st = response_stats(model, ids, pm, resp, rm, chunk_size=2)
    st_ref = response_stats(ref, ids, pm, resp, rm, chunk_size=2)
    assert torch.allclose(st.logp, st_ref.logp, atol=1e-5)
    st.logp.sum().backward()
    st_ref.logp.sum().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):  # summed over the 2 ranks
        g = dist.full_tensor(p.grad)
        assert torch.allclose(g, 2 * q.grad, atol=1e-5, rtol=1e-4), (n, (g - 2 * q.grad).abs().max())
    print(f"[check] rank {r}: ok", flush=True)
    dist.teardown()


if __name__ == "__main__":
    import faulthandler
    import os

    if os.environ.get("TETHER_TEST_DUMP_AFTER_S"):  # a hang prints every thread's stack, then exits
        faulthandler.dump_traceback_later(float(os.environ["TETHER_TEST_DUMP_AFTER_S"]), exit=True)
    if sys.argv[1] == "check":
        check(sys.argv[2])
    else:
        from tether.cli import main

        sys.exit(main(sys.argv[1:]))
