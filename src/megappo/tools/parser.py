"""Tool calls from the model's text in the hermes format (what Qwen models emit), checked against
the tools' schemas.

A call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; one turn may hold several.
Every block becomes a :class:`ToolCall`; a block that cannot be run carries an error ``kind`` and a
message that becomes the tool's response, so bad output is a turn the model sees, never a crash.
(verl's hermes parser drops undecodable blocks silently and runs unknown names into an error
text; megappo answers every block.)
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
OPEN = "<tool_call>"

# error kinds, the suffixes of the tools/errors/<kind> metrics
MALFORMED_JSON = "malformed_json"        # the block is not a JSON object
MALFORMED_CALL = "malformed_call"        # JSON, but not {"name": str, "arguments": object}
UNCLOSED = "unclosed_tool_call"          # <tool_call> without </tool_call>
UNKNOWN_TOOL = "unknown_tool"
INVALID_ARGUMENTS = "invalid_arguments"  # arguments fail the tool's schema (type, required, enum, unknown)
TOO_MANY_CALLS = "too_many_calls"        # past multi_turn.max_parallel_calls in one turn
TOOL_EXCEPTION = "tool_exception"        # the tool raised
TIMEOUT = "timeout"                      # the tool ran past its wall-clock limit
ERROR_KINDS = (MALFORMED_JSON, MALFORMED_CALL, UNCLOSED, UNKNOWN_TOOL, INVALID_ARGUMENTS, TOO_MANY_CALLS,
               TOOL_EXCEPTION, TIMEOUT)


@dataclass
class ToolCall:
    """One ``<tool_call>`` block: a runnable call (``error`` None) or why it is not."""
    name: Optional[str]
    arguments: dict = field(default_factory=dict)
    error: Optional[str] = None
    message: str = ""
    raw: str = ""


def _decode(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(None, error=MALFORMED_JSON, raw=body,
                        message=f"Error: the tool call is not valid JSON ({e.msg} at character {e.pos}); expected "
                                f'{{"name": <tool name>, "arguments": {{...}}}}')
    name = obj.get("name") if isinstance(obj, dict) else None
    args = obj.get("arguments", {}) if isinstance(obj, dict) else None
    if isinstance(args, str):            # some models encode the arguments object as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(name, str) or not isinstance(args, dict):
        return ToolCall(name if isinstance(name, str) else None, error=MALFORMED_CALL, raw=body,
                        message='Error: a tool call must be {"name": <tool name>, "arguments": {...}}, got '
                                + body.strip()[:200])
    return ToolCall(name, args, raw=body)


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """The text outside the tool-call blocks, and every block as a :class:`ToolCall` in order
    (a last ``<tool_call>`` that is never closed is an error call)."""
    calls = [_decode(m.group(1)) for m in TOOL_CALL.finditer(text)]
    content = TOOL_CALL.sub("", text)
    if OPEN in content:
        tail = content[content.index(OPEN):]
        calls.append(ToolCall(None, error=UNCLOSED, raw=tail,
                              message="Error: <tool_call> was not closed with </tool_call>"))
        content = content[:content.index(OPEN)]
    return content, calls


# multi_turn.format -> the parser of that format
PARSERS = {"hermes": parse_hermes}

_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
          "object": (dict,), "null": (type(None),)}


def _type_ok(value: Any, types: list[str]) -> tuple[bool, Any]:
    """Whether ``value`` has one of the JSON ``types`` (a whole float counts as an integer and
    becomes one; a bool is not a number)."""
    for t in types:
        if t in ("integer", "number") and isinstance(value, bool):
            continue
        if t == "integer" and isinstance(value, float) and value.is_integer():
            return True, int(value)
        if isinstance(value, _TYPES.get(t, (object,))):
            return True, value
    return False, value


def check_arguments(schema: dict, arguments: dict) -> tuple[Optional[str], dict]:
    """``(problem or None, arguments)`` for a tool's OpenAI function schema: required parameters
    present, no parameter the schema lacks (unless ``additionalProperties``), each of its JSON
    type (or null when ``nullable``) and in its ``enum``."""
    params = schema["function"].get("parameters") or {}
    props = params.get("properties") or {}
    missing = [r for r in params.get("required", []) if r not in arguments]
    if missing:
        return f"missing required argument(s) {', '.join(missing)}", arguments
    unknown = [k for k in arguments if k not in props]
    if unknown and not params.get("additionalProperties", False):
        return f"unexpected argument(s) {', '.join(unknown)} (expected: {', '.join(props) or 'none'})", arguments
    out = dict(arguments)
    for k, v in arguments.items():
        spec = props.get(k) or {}
        if v is None and spec.get("nullable"):
            continue
        types = spec.get("type")
        if types is not None:
            ok, out[k] = _type_ok(v, types if isinstance(types, list) else [types])
            if not ok:
                return f"argument {k} must be of type {types}, got {json.dumps(v)[:80]}", arguments
        if "enum" in spec and out[k] not in spec["enum"]:
            return f"argument {k} must be one of {spec['enum']}, got {json.dumps(v)[:80]}", arguments
    return None, out


def check_call(call: ToolCall, schemas: dict[str, dict]) -> ToolCall:
    """The call with ``error`` set when its tool is unknown or its arguments fail the schema."""
    if call.error:
        return call
    if call.name not in schemas:
        return ToolCall(call.name, call.arguments, UNKNOWN_TOOL, raw=call.raw,
                        message=f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(schemas)) or 'none'}")
    problem, args = check_arguments(schemas[call.name], call.arguments)
    if problem:
        return ToolCall(call.name, call.arguments, INVALID_ARGUMENTS, raw=call.raw,
                        message=f"Error: {call.name}: {problem}")
    return ToolCall(call.name, args, raw=call.raw)
