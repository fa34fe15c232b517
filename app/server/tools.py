"""Tool calling for the OpenAI API: checking `tools` and `tool_choice`, the response format that
makes a forced or chosen call valid JSON under its function's parameter schema, and reading the
calls back out of the reply text.

The model's chat template renders the tools (only templates that use `tools` can: Qwen2.5,
Llama 3.1/3.2, Hermes ...). A call is written the way the template family writes it:

    tag:   <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>     (Qwen2.5, Hermes)
    json:  {"name": "f", "parameters": {...}}                               (Llama 3.x)
    harmony: <|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>
                                                                        (gpt-oss)

A structural-tag response format (engine/grammar.py turns it into an llguidance grammar)
constrains it: with tool_choice "auto" the reply is free text until the call's opening, then the
call under its schema; with "required" or a named function the reply is exactly one call.

A harmony model's calls are messages of their own, which the engine's HarmonySplitter keeps out
of the reply's text (`Reply.tool_calls`): "auto" leaves the model to write them unconstrained,
"required" is a Lark grammar over its special tokens that opens the reply with one call.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from localchat.engine import harmony_call_grammar
from localchat.errors import InvalidRequestError

HARMONY = "harmony"  # the tool-call style of OpenAI's harmony format (gpt-oss)
HARMONY_RECIPIENT = "functions."  # a harmony call's recipient: functions.<name>
NAME_RE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Tool:
    """One function the model may call."""

    name: str
    parameters: Mapping[str, Any]
    definition: Mapping[str, Any]  # as the client sent it, for the template


def check_tools(tools: Sequence[Any] | None) -> list[Tool]:
    """The request's `tools`, checked (InvalidRequestError naming the bad entry)."""
    out: list[Tool] = []
    seen: set[str] = set()
    for i, item in enumerate(tools or []):
        where = f"tools[{i}]"
        if not isinstance(item, Mapping) or item.get("type") != "function":
            raise InvalidRequestError(f'{where}: only {{"type": "function", ...}} tools are '
                                      f"supported", where)
        fn = item.get("function")
        if not isinstance(fn, Mapping):
            raise InvalidRequestError(f"{where}.function must be an object", f"{where}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise InvalidRequestError(
                f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r}",
                f"{where}.function.name")
        if name in seen:
            raise InvalidRequestError(f"{where}: the function name {name!r} is used twice",
                                      f"{where}.function.name")
        seen.add(name)
        params = fn.get("parameters", ANY_OBJECT)
        if not isinstance(params, Mapping):
            raise InvalidRequestError(f"{where}.function.parameters must be a JSON Schema object",
                                      f"{where}.function.parameters")
        out.append(Tool(name, dict(params) or ANY_OBJECT, dict(item)))
    return out


def chosen_tools(tools: list[Tool], choice: Any) -> tuple[str, list[Tool]]:
    """(mode, tools the reply may call) for a `tool_choice`: mode "none", "auto" or
    "required" (a named function is "required" with just that one)."""
    if choice is None:
        return ("auto" if tools else "none"), tools
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f'tool_choice must be "none", "auto", "required" or {{"type": "function", '
                f'"function": {{"name": ...}}}}, got {choice!r}', "tool_choice")
        if choice != "none" and not tools:
            raise InvalidRequestError(f"tool_choice {choice!r} needs tools", "tool_choice")
        return choice, tools
    fn = choice.get("function") if isinstance(choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(choice, Mapping) or choice.get("type") != "function" or not name:
        raise InvalidRequestError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            '"function": {"name": ...}}', "tool_choice")
    picked = [t for t in tools if t.name == name]
    if not picked:
        known = ", ".join(t.name for t in tools) or "none"
        raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not in "
                                  f"tools (known: {known})", "tool_choice")
    return "required", picked


def _call_parts(style: str, name: str) -> tuple[str, str]:
    """(text before the arguments, text after them) of one call in a template's style."""
    quoted = json.dumps(name)
    if style == "tag":
        return f'<tool_call>\n{{"name": {quoted}, "arguments": ', "}\n</tool_call>"
    return f'{{"name": {quoted}, "parameters": ', "}"


def call_trigger(style: str) -> str:
    """The text that opens a call in `style`."""
    return "<tool_call>" if style == "tag" else '{"name": '


def streamable(text: str, style: str) -> int:
    """How much of a reply's text so far is surely content, not the start of a call: all of
    it up to a call's opening, less an ending that could still grow into one (all of it for a
    harmony model, whose calls never reach the text)."""
    if style == HARMONY:
        return len(text)
    trigger = call_trigger(style)
    at = text.find(trigger)
    if at >= 0:
        return at
    for k in range(min(len(trigger) - 1, len(text)), 0, -1):
        if text.endswith(trigger[:k]):
            return len(text) - k
    return len(text)


def call_format(style: str, mode: str, tools: Sequence[Tool]) -> dict[str, Any] | None:
    """The response format (a structural tag, see engine/grammar.py) for calls in `style`: any
    text or one call when mode is "auto", exactly one call when it is "required". None (no
    constraint) for a harmony model's "auto": it writes its calls in its own channels."""
    if style == HARMONY:
        return harmony_call_format(tools) if mode == "required" else None
    tags = []
    for tool in tools:
        begin, end = _call_parts(style, tool.name)
        tags.append({"type": "tag", "begin": begin, "end": end,
                     "content": {"type": "json_schema", "json_schema": dict(tool.parameters)}})
    trigger = call_trigger(style)
    return {"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": [trigger], "tags": tags,
        "at_least_one": mode == "required", "stop_after_first": True}}


def harmony_call_format(tools: Sequence[Tool]) -> dict[str, Any]:
    """The response format that makes a harmony reply one call to one of `tools`, its
    arguments under the function's schema (`engine.harmony_call_grammar`)."""
    grammar = harmony_call_grammar([(tool.name, tool.parameters) for tool in tools])
    return {"type": "grammar", "grammar": grammar}


def tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a tool-capable template: an assistant's calls keep their `tool_calls` with
    the arguments as an object (as transformers' templates expect), tool results keep their
    `tool_call_id`."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for call in calls:
                call = dict(call)
                fn = dict(call.get("function") or {})
                args = fn.get("arguments")
                if isinstance(args, str):
                    try:
                        fn["arguments"] = json.loads(args)
                    except json.JSONDecodeError:
                        pass
                call["function"] = fn
                fixed.append(call)
            m["tool_calls"] = fixed
        out.append(m)
    return out


@dataclass
class ToolCall:
    """A call found in a reply."""

    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        """OpenAI's `tool_calls` entry (with `index` for a streamed delta)."""
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out = {"index": index, **out}
        return out


def harmony_tool_calls(calls: Sequence[Any], tools: Sequence[Tool]) -> list[ToolCall]:
    """A harmony reply's calls (`Reply.tool_calls`: the engine's HarmonyCall, with `recipient`,
    `arguments` and `complete`) that OpenAI's API can return: complete, to `functions.<a known
    tool>`, with a JSON object for arguments (others are left out)."""
    names = {t.name for t in tools}
    out = []
    for call in calls:
        name = call.recipient.removeprefix(HARMONY_RECIPIENT)
        if not call.complete or not call.recipient.startswith(HARMONY_RECIPIENT) \
                or name not in names:
            continue
        try:
            args = json.loads(call.arguments)
        except json.JSONDecodeError:
            continue
        if isinstance(args, dict):
            out.append(ToolCall(name, json.dumps(args, ensure_ascii=False),
                                f"call_{uuid.uuid4().hex[:24]}"))
    return out


def parse_calls(text: str, style: str, tools: Sequence[Tool],
                harmony: Sequence[Any] = ()) -> tuple[str, list[ToolCall]]:
    """(content before the calls, the calls) in a reply's text; a text without a complete,
    known call is all content. A harmony model's calls are not in its text: they are
    `harmony`, the reply's `tool_calls`."""
    if style == HARMONY:
        found = harmony_tool_calls(harmony, tools)
        return (text.strip() if found else text), found
    names = {t.name for t in tools}
    key = "arguments" if style == "tag" else "parameters"
    if style == "tag":
        start = text.find("<tool_call>")
        if start < 0:
            return text, []
        bodies = re.findall(r"<tool_call>\s*(.*?)\s*</tool_call>", text[start:], re.DOTALL)
        content = text[:start]
    else:
        start = text.find('{"name"')
        if start < 0:
            return text, []
        bodies = [text[start:].strip()]
        content = text[:start]
    calls = []
    for body in bodies:
        try:
            data = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(data, dict) or data.get("name") not in names:
            return text, []
        args = data.get(key, data.get("arguments", {}))
        calls.append(ToolCall(data["name"], json.dumps(args, ensure_ascii=False),
                              f"call_{uuid.uuid4().hex[:24]}"))
    if not calls:
        return text, []
    return content.strip(), calls
