"""Rollout engines: sample groups of responses from the policy.

`SamplingParams`, `RolloutBatch` and the `Engine` protocol live in `tether.rollout.base`
(torch only); `HFEngine` (transformers ``generate`` on the training model) in
`tether.rollout.hf`, imported lazily so that importing this package does not load
transformers.
"""

from .base import Engine, RolloutBatch, SamplingParams

__all__ = ["Engine", "HFEngine", "RolloutBatch", "SamplingParams"]


def __getattr__(name):
    """Lazily import `HFEngine` (pulls in transformers)."""
    if name == "HFEngine":
        from .hf import HFEngine

        return HFEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
