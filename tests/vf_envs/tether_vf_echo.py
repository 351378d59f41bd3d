"""A verifiers MultiTurnEnv for tether's vLLM test (tests/test_vllm.py): every assistant turn gets the user message
"Once more." until ``max_turns``; the rubric gives 1 to an episode whose last turn wrote anything. Loaded as
``verifiers:tether_vf_echo``."""

import verifiers as vf
from datasets import Dataset


class Echo(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [vf.UserMessage(content="Once more.")]


def load_environment(n: int = 4, max_turns: int = 2):
    rows = [{"question": f"Say something about {i}.", "answer": ""} for i in range(n)]

    async def wrote(completion, **kwargs) -> float:
        return 1.0 if completion and getattr(completion[-1], "content", None) else 0.0

    return Echo(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[wrote]), max_turns=max_turns)
