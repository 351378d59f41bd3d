"""The in-process verifiers client of `tether.agents.verifiers.VerifiersAgent`: a ``vf.Client`` whose
``get_response`` asks the agent for the turn (and so tether's engine), and the conversions between verifiers'
messages and tools and the chat template's.
"""

from __future__ import annotations

import time

from ..errors import ConfigError

__all__ = ["MODEL_NAME", "Native", "client_class", "dump_messages", "tool_dict"]

MODEL_NAME = "tether-policy"  # what the environment is told the model is called


def dump_messages(messages) -> list[dict]:
    """verifiers messages (pydantic models or dicts) as plain dicts without empty fields."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m)
        out.append({k: v for k, v in d.items() if v is not None})
    return out


class Native:
    """What the engine answered one turn (the client's native response)."""

    def __init__(self, prompt_ids, ids, logp, text, reason, content, calls):
        self.prompt_ids, self.ids, self.logp, self.text, self.reason = prompt_ids, ids, logp, text, reason
        self.content, self.calls = content, calls


def tool_dict(tool) -> dict:
    """A ``vf.Tool`` as a chat template's (and an OpenAI client's) tool definition."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": tool.parameters}}


_CLIENTS: dict[int, type] = {}


def client_class(vf) -> type:
    """The ``vf.Client`` subclass whose turns the agent answers with its engine (built once per library)."""
    if id(vf) in _CLIENTS:
        return _CLIENTS[id(vf)]
    T = vf.types

    class EngineClient(vf.Client):
        """An in-process verifiers client: ``get_response`` asks the agent (and so tether's engine)."""

        def setup_client(self, config):
            raise ConfigError("the tether engine client is built around an agent, not a ClientConfig")

        async def to_native_tool(self, tool):
            return tool_dict(tool)

        async def to_native_prompt(self, messages):
            return dump_messages(messages), {}

        async def get_native_response(self, prompt, model, sampling_args, tools=None, **kwargs):
            return await self.client._turn(prompt, tools)

        async def raise_from_native_response(self, response):
            return None  # the engine's answer is always a response (its failures raised in get_native_response)

        async def from_native_response(self, r: Native):
            truncated = r.reason == "length"
            finish = "tool_calls" if r.calls else ("length" if truncated else "stop")
            calls = [T.ToolCall(id=c["id"], name=c["name"], arguments=c["arguments"]) for c in r.calls] or None
            tokens = T.ResponseTokens(prompt_ids=list(r.prompt_ids), prompt_mask=[0] * len(r.prompt_ids),
                                      completion_ids=list(r.ids), completion_mask=[1] * len(r.ids),
                                      completion_logprobs=list(r.logp))
            msg = T.ResponseMessage(content=r.content, tool_calls=calls, finish_reason=finish, is_truncated=truncated,
                                    tokens=tokens)
            usage = T.Usage(prompt_tokens=len(r.prompt_ids), reasoning_tokens=0, completion_tokens=len(r.ids),
                            total_tokens=len(r.prompt_ids) + len(r.ids))
            return T.Response(id=f"tether-{time.monotonic_ns()}", created=int(time.time()), model=MODEL_NAME,
                              usage=usage, message=msg)

        async def close(self):
            return None

    _CLIENTS[id(vf)] = EngineClient
    return EngineClient
