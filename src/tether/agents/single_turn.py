"""The default agent: one prompt, one response, no tools."""

from __future__ import annotations

from typing import Sequence

from ..rollout.base import RolloutBatch, SamplingParams
from ..tasks.base import Example
from ..tasks.prompts import agent_prompt_encoder


class SingleTurnAgent:
    """Encodes each example's prompt through the chat template and samples ``params.n`` responses.

    Args:
        engine: a ``tether.rollout.Engine``.
        tokenizer: the policy's tokenizer.
        system_prompt: a system message before every prompt ("" = none).
        prompt_overflow: a prompt that leaves less than ``max_new_tokens`` of the model's
            context: ``"error"`` or ``"truncate"`` (``tether.tasks.prompts.PromptEncoder``).
    """

    def __init__(self, engine, tokenizer, system_prompt: str = "", prompt_overflow: str = "error"):
        self.engine, self.tokenizer, self.system_prompt = engine, tokenizer, system_prompt
        self.prompts = agent_prompt_encoder(engine, tokenizer, system_prompt, prompt_overflow)

    def rollout(self, examples: Sequence[Example], params: SamplingParams) -> RolloutBatch:
        """``params.n`` responses per example; every response token is the policy's (loss_mask = response_mask)."""
        return self.engine.generate(self.prompts.encode(examples, params.max_new_tokens), params)

    def metrics(self) -> dict[str, float]:
        """No counters of its own: generation statistics come from the batch."""
        return {}
