"""A verifiers 0.4 taskset for tether's tests (the task API, ``verifiers.v1``): add two numbers, with an ``add`` tool
served by its own MCP process (``python -m tether_vf1_add``, so this directory must be on PYTHONPATH).

Config: ``size`` tasks; ``digits``: 0 asks i + 2i for task i, D > 0 two random D-digit numbers (drawn with ``seed``:
another seed, other problems: the held-out set); ``reward``: ``answer`` (1 when the reply contains the sum),
``last_number`` (1 when the reply's last number is the sum), ``spread`` (a number in [0, 1) computed from the reply's
characters: two different replies almost surely score differently, whatever the policy writes, so a group's
advantages are not all zero; the share of digits, used before, was 0 for every reply of the tiny random model in one
CI run) or ``raise`` (the reward raises: an error test)."""
import random
import re

import verifiers.v1 as vf


class AddTools(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers and return the sum."""
        return a + b


class AddData(vf.TaskData):
    answer: str = ""
    reward: str = "answer"


class AddTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class AddTask(vf.Task[AddData, vf.State, AddTaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [AddTools(config.tools)]

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        reply = trace.last_reply or ""
        if self.data.reward == "raise":
            raise RuntimeError("the test's reward raises on purpose")
        if self.data.reward == "spread":
            return sum((i + 1) * ord(c) for i, c in enumerate(reply)) % 997 / 997
        if self.data.reward == "last_number":
            numbers = re.findall(r"-?\d+", reply)
            return 1.0 if numbers and numbers[-1] == self.data.answer else 0.0
        return 1.0 if self.data.answer in reply else 0.0


class AddConfig(vf.TasksetConfig):
    task: AddTaskConfig = AddTaskConfig()
    size: int = 8
    digits: int = 0
    seed: int = 0
    reward: str = "answer"


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self):
        c, rng = self.config, random.Random(f"tether_vf1_add|{self.config.seed}")
        tasks = []
        for i in range(c.size):
            a, b = (i, 2 * i) if not c.digits else (rng.randrange(10 ** (c.digits - 1), 10 ** c.digits),
                                                     rng.randrange(10 ** (c.digits - 1), 10 ** c.digits))
            prompt = f"What is {a} + {b}?" + (" Use the calc_add tool." if not c.digits else " Answer with the number.")
            tasks.append(AddTask(AddData(prompt=prompt, answer=str(a + b), reward=c.reward), c.task))
        return tasks


__all__ = ["AddTaskset"]

if __name__ == "__main__":
    AddTools.run()
