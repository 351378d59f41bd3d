"""tether: reinforcement learning of language models with verifiable rewards.

The layout follows the data flow of one training step:

    rollout/  -> tasks/ (rewards) -> algo/advantages -> logprobs (policy, sampler, anchor)
              -> algo/ (kl, trust_region, objectives, aggregation) -> anchor update -> train

`tether.algo` is plain PyTorch on tensors and imports nothing but torch.
"""

__version__ = "0.1.0"
