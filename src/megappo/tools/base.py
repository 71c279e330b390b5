"""The tool interface (shaped like verl's ``BaseTool``) and plain Python functions as tools.

A tool is called by the model with JSON arguments and answers with text. Class tools keep state
per instance (one instance per sample and tool, for the sample's whole trajectory); function
tools are stateless. Methods are synchronous: the runner calls them from a thread pool, so a
slow tool does not hold the others up (verl's are ``async``; an ``async`` method of a verl tool
class is awaited in its worker thread, so such classes work here too).
"""
from __future__ import annotations

import asyncio
import inspect
import json
import re
import types
import typing
import uuid
from typing import Any, Callable, Optional


def function_schema(name: str, description: str, properties: dict, required: list[str]) -> dict:
    """An OpenAI function tool schema: ``{type: function, function: {name, description, parameters}}``."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(required)}}}


def _resolve(value: Any) -> Any:
    # verl's tools are async; ours are not. A coroutine from a verl-style class runs to its end here,
    # in the runner's worker thread (which has no running event loop).
    return asyncio.run(value) if inspect.iscoroutine(value) else value


class Tool:
    """Base class of a tool. Subclass it, override :meth:`execute` (and :meth:`create`,
    :meth:`calc_reward`, :meth:`release` for state), and name it in a tool config YAML.

    ``config`` is the YAML entry's ``config`` mapping; ``tool_schema`` its OpenAI function schema
    (a dict), or None to use :meth:`get_openai_tool_schema` of the subclass.
    """

    def __init__(self, config: Optional[dict] = None, tool_schema: Optional[dict] = None):
        self.config = dict(config or {})
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if not self.tool_schema:
            raise ValueError(f"{type(self).__name__} has no tool schema: pass tool_schema or override "
                             f"get_openai_tool_schema()")
        self.name = self.tool_schema["function"]["name"]

    def get_openai_tool_schema(self) -> Optional[dict]:
        return getattr(self, "tool_schema", None)

    def create(self, instance_id: Optional[str] = None, **kwargs) -> str:
        """Start the state of one trajectory; ``kwargs`` are the row's
        ``extra_info.tools_kwargs.<tool>.create_kwargs``. Returns the instance id."""
        return instance_id if instance_id is not None else uuid.uuid4().hex

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[str, float, dict]:
        """Run one call: ``(response text, step reward, metrics)``."""
        return "", 0.0, {}

    def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    def release(self, instance_id: str, **kwargs) -> None:
        pass


def normalise_result(ret: Any) -> tuple[str, float, dict]:
    """A tool's return value as ``(text, reward, metrics)``: a string, a dict (JSON), a tuple of
    one to three items, or an object with a ``text`` attribute (verl's ``ToolResponse``)."""
    ret = _resolve(ret)
    if isinstance(ret, tuple):
        if not 1 <= len(ret) <= 3:
            raise TypeError(f"a tool returned a tuple of {len(ret)} items; expected (response,), (response, reward) "
                            f"or (response, reward, metrics)")
        text = normalise_result(ret[0])[0]
        reward = 0.0 if len(ret) < 2 or ret[1] is None else float(ret[1])
        return text, reward, ({} if len(ret) < 3 or ret[2] is None else dict(ret[2]))
    if isinstance(ret, str):
        return ret, 0.0, {}
    if isinstance(ret, dict):
        return json.dumps(ret, ensure_ascii=False), 0.0, {}
    if hasattr(ret, "text") and not isinstance(ret, (int, float)):
        return ret.text or "", 0.0, {}
    return str(ret), 0.0, {}


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def _json_type(hint: Any, where: str) -> dict:
    """JSON schema of a type hint, as transformers' get_json_schema (verl's schema builder) writes it."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if origin in (list, tuple):
        return {"type": "array", **({"items": _json_type(args[0], where)} if origin is list and args else {})}
    if origin is dict:
        return {"type": "object"}
    if origin is typing.Literal:
        return {"type": _JSON_TYPES.get(type(args[0]), "string"), "enum": list(args)}
    if origin in (typing.Union, getattr(types, "UnionType", None)):
        inner = [_json_type(a, where) for a in args if a is not type(None)]
        out = inner[0] if len(inner) == 1 else {"type": [t["type"] for t in inner]}
        return {**out, "nullable": True} if type(None) in args else out
    raise TypeError(f"{where}: type hint {hint!r} has no JSON schema type (use str, int, float, bool, list, dict, "
                    f"Literal or Optional of these)")


def _docstring_args(doc: str) -> tuple[str, dict[str, str]]:
    """The summary (text before the first section) and each parameter's description from a
    Google-style ``Args:`` section."""
    doc = inspect.cleandoc(doc or "")
    parts = re.split(r"^\s*(Args|Arguments|Returns|Raises|Yields|Examples?|Notes?):\s*$", doc, flags=re.M)
    summary = parts[0].strip()
    args: dict[str, str] = {}
    for head, body in zip(parts[1::2], parts[2::2]):
        if head not in ("Args", "Arguments"):
            continue
        current = None
        for line in body.splitlines():
            m = re.match(r"^\s*(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", line)
            if m and (current is None or len(line) - len(line.lstrip()) <= args_indent):
                current, args_indent = m.group(1), len(line) - len(line.lstrip())
                args[current] = m.group(3).strip()
            elif current and line.strip():
                args[current] = (args[current] + " " + line.strip()).strip()
    return summary, args


def schema_from_function(fn: Callable, name: Optional[str] = None) -> dict:
    """The OpenAI function schema of ``fn``: every parameter needs a type hint; descriptions come
    from the docstring (summary, ``Args:`` section); parameters without a default are required."""
    name = name or fn.__name__
    where = f"function tool {name!r} ({fn.__module__}.{fn.__qualname__})"
    hints = typing.get_type_hints(fn)
    summary, described = _docstring_args(fn.__doc__ or "")
    if not summary:
        raise ValueError(f"{where}: needs a docstring whose first lines say what the tool does")
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"{where}: *{p.name} cannot be described in a tool schema; name each parameter")
        if p.name not in hints:
            raise TypeError(f"{where}: parameter {p.name!r} needs a type hint")
        props[p.name] = _json_type(hints[p.name], f"{where}, parameter {p.name!r}")
        if p.name in described:
            props[p.name]["description"] = described[p.name]
        if p.default is p.empty:
            required.append(p.name)
    return function_schema(name, summary, props, required)


class FunctionTool(Tool):
    """A plain Python function as a (stateless) tool; its schema comes from its signature and
    docstring unless one is given. It may return what :func:`normalise_result` accepts."""

    def __init__(self, fn: Callable, name: Optional[str] = None, tool_schema: Optional[dict] = None):
        self.fn = fn
        super().__init__({}, tool_schema or schema_from_function(fn, name))

    def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[str, float, dict]:
        return normalise_result(self.fn(**parameters))


def function_tool(fn: Optional[Callable] = None, *, name: Optional[str] = None, schema: Optional[dict] = None):
    """Mark a function as a tool for ``multi_turn.function_tool_path`` files: ``@function_tool`` or
    ``@function_tool(name="other_name")``. The function stays callable as before."""
    def mark(f: Callable) -> Callable:
        f.__megappo_tool__ = FunctionTool(f, name=name, tool_schema=schema)
        return f
    return mark(fn) if fn is not None else mark
