"""Tool calls as the policy writes them: the tool definitions for a template that renders none, the format a chat
template's model family uses, and the parser of a turn's text into calls (`tether.agents.verifiers`).

Formats: ``hermes`` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: Qwen 2.5 / 3, SmolLM, Hermes;
and the format tether describes the tools in when a template renders none) and ``llama3_json`` (Llama 3.1+: a JSON
object ``{"name": ..., "parameters": {...}}``, optionally after ``<|python_tag|>``).
"""

from __future__ import annotations

import json
import re

from ..errors import ConfigError
from ..userio import loads_json

__all__ = ["parse_tool_calls", "template_tool_format", "tools_system_text"]

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def tools_system_text(tools: list[dict]) -> str:
    """The tool definitions for a template that renders none, in the Hermes format the parser reads."""
    defs = "\n".join(json.dumps(t, sort_keys=True) for t in tools)
    return ("You can call functions. Their signatures, one JSON object per line:\n<tools>\n" + defs + "\n</tools>\n"
            "To call one, write a JSON object with its name and arguments between <tool_call> and </tool_call>:\n"
            '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n</tool_call>')


def template_tool_format(tokenizer, requested: str = "auto") -> tuple[str, bool]:
    """``(tool format, renders_tools)`` for ``tokenizer``'s chat template: whether the template itself writes the
    tool definitions (else :func:`tools_system_text` goes in the system message) and the format tool calls are
    parsed in. ``auto``: ``hermes`` for a template with ``<tool_call>`` or none of its own, ``llama3_json`` for one
    with ``<|python_tag|>``; a template that renders tools in another format is a ConfigError."""
    probe = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "probe_fn", "description": "d",
                                             "parameters": {"type": "object", "properties": {}}}}
    plain = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    try:
        withs = tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001  (a template that refuses tools= renders none)
        withs = plain
    renders = withs != plain
    if requested != "auto":
        return requested, renders
    source = str(getattr(tokenizer, "chat_template", "") or "")
    if not renders or "<tool_call>" in source:
        return "hermes", renders
    if "<|python_tag|>" in source:
        return "llama3_json", renders
    raise ConfigError("this model's chat template renders tool definitions in a format tether does not parse (it "
                      "parses hermes <tool_call> blocks: Qwen, SmolLM, Hermes; and Llama 3 JSON calls); set "
                      "rollout.agent.env.options.tool_format=hermes or llama3_json if the model writes one of them")


def parse_tool_calls(text: str, fmt: str, turn: int = 0) -> tuple[str, list[dict[str, str]]]:
    """``(content, calls)`` of a turn's text: the text before the first call, and each call as ``{"id", "name",
    "arguments"}`` (arguments: a JSON string). A call whose JSON does not parse is ``name="invalid"`` with the raw
    text as its arguments."""
    calls: list[tuple[str, str]] = []
    if fmt == "hermes":
        found = list(_HERMES.finditer(text))
        content = text[:found[0].start()].strip() if found else text
        for m in found:
            calls.append(_call(m.group(1), "arguments"))
    elif fmt == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith(("{", "[")):
            return text, []
        content = ""
        try:
            obj = loads_json(body)
        except ValueError:
            calls.append(("invalid", body))
        else:
            for o in obj if isinstance(obj, list) else [obj]:
                calls.append(_call(json.dumps(o), "parameters"))
    else:
        raise ConfigError(f"unknown tool format {fmt!r} (known: hermes, llama3_json)")
    return content, [{"id": f"call_{turn}_{k}", "name": n, "arguments": a} for k, (n, a) in enumerate(calls)]


def _call(body: str, args_key: str) -> tuple[str, str]:
    try:
        obj = loads_json(body)
    except ValueError:
        return "invalid", body
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return "invalid", body
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return obj["name"], args if isinstance(args, str) else json.dumps(args)
