"""Tools from files: a tool config YAML in verl's shape, and a Python file of ``@function_tool``
functions (verl's ``tool_config_path`` and ``function_tool_path``).

The YAML::

    tools:
      - class_name: pkg.mod.Class          # a megappo.tools.Tool subclass (or a verl BaseTool-shaped class)
        config: {type: native, ...}        # passed to the class; verl requires type: native
        tool_schema:                       # optional when the class supplies its own
          type: function
          function: {name: ..., description: ..., parameters: {type: object, properties: {...}, required: [...]}}
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from .base import Tool


class ToolConfigError(ValueError):
    """A tool file that cannot be used; the message names the file, the entry and the field."""


@dataclass
class ToolSpec:
    """One entry of a tool config YAML, checked but not yet imported."""
    class_name: str
    config: dict
    tool_schema: Optional[dict]
    where: str


def _check_schema(schema: Any, where: str) -> dict:
    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(schema.get("function"), dict):
        raise ToolConfigError(f"{where}.tool_schema: expected {{type: function, function: {{name, description, "
                              f"parameters}}}}, got {schema!r}")
    fn = schema["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolConfigError(f"{where}.tool_schema.function.name: expected the tool's name (a string), got "
                              f"{fn.get('name')!r}")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if (not isinstance(params, dict) or params.get("type") != "object"
            or not isinstance(params.get("properties", {}), dict)):
        raise ToolConfigError(f"{where}.tool_schema.function.parameters: expected {{type: object, properties: "
                              f"{{...}}, required: [...]}}, got {params!r}")
    required = params.get("required", [])
    unknown = [r for r in required if r not in params.get("properties", {})] if isinstance(required, list) else required
    if not isinstance(required, list) or unknown:
        raise ToolConfigError(f"{where}.tool_schema.function.parameters.required: expected a list of names from "
                              f"properties, got {required!r}")
    return schema


def class_entries(path: str | Path, section: str, fields: str, nonempty: bool = False) -> list[tuple[str, dict, str, dict]]:
    """The entries of a YAML file's ``section`` list that each name a class (verl's tool and
    interaction files): ``(where, entry, class_name, config)``, checked without importing
    anything; errors name the file, the entry and the field (``fields``: what an entry holds)."""
    path = Path(path).expanduser()
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ToolConfigError(f"{path}: cannot be read ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ToolConfigError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get(section), list) or (nonempty and not doc[section]):
        raise ToolConfigError(f"{path}: expected a mapping with a{' non-empty' if nonempty else ''} {section!r} list, "
                              f"got {type(doc).__name__}")
    out = []
    for i, entry in enumerate(doc[section]):
        where = f"{path}: {section}[{i}]"
        if not isinstance(entry, dict):
            raise ToolConfigError(f"{where}: expected a mapping with {fields}; got {entry!r}")
        cls = entry.get("class_name")
        if not isinstance(cls, str) or "." not in cls:
            raise ToolConfigError(f"{where}.class_name: expected a dotted path pkg.module.Class, got {cls!r}")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ToolConfigError(f"{where}.config: expected a mapping, got {config!r}")
        out.append((where, entry, cls, config))
    return out


def read_tool_config(path: str | Path) -> list[ToolSpec]:
    """Parse and check a tool config YAML without importing any tool class."""
    specs, names = [], {}
    for i, (where, entry, cls, config) in enumerate(class_entries(path, "tools", "class_name, config, tool_schema")):
        if config.get("type", "native") != "native":
            raise ToolConfigError(f"{where}.config.type: only native tools are supported (verl's MCP tools are "
                                  f"not), got {config['type']!r}")
        schema = _check_schema(entry["tool_schema"], where) if entry.get("tool_schema") is not None else None
        name = schema["function"]["name"] if schema else None
        if name in names:
            raise ToolConfigError(f"{where}.tool_schema.function.name: {name!r} is already tools[{names[name]}]'s")
        if name:
            names[name] = i
        specs.append(ToolSpec(cls, config, schema, where))
    return specs


_ENV = re.compile(r"\$\{oc\.env:\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:,([^}]*))?\}")


def resolve_env(value: Any, where: str) -> Any:
    """OmegaConf's ``${oc.env:NAME}`` / ``${oc.env:NAME,default}`` in a tool's or interaction's
    config (verl resolves these files with OmegaConf: API keys and endpoints are passed so),
    resolved where the class is built; an unset variable without a default names it."""
    if isinstance(value, dict):
        return {k: resolve_env(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_env(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if not isinstance(value, str) or "${oc.env:" not in value:
        return value

    def one(m) -> str:
        name, default = m.group(1), m.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is None:
            raise ToolConfigError(f"{where}: environment variable {name} is not set (and ${{oc.env:{name}}} "
                                  "gives no default)")
        return default.strip().strip("'\"")

    whole = _ENV.fullmatch(value.strip())
    if whole and whole.group(2) is not None and whole.group(2).strip() == "null" and whole.group(1) not in os.environ:
        return None
    return _ENV.sub(one, value)


def import_class(dotted: str, where: str) -> type:
    module_name, _, attr = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ToolConfigError(f"{where}.class_name: cannot import module {module_name!r} ({e})") from None
    if not hasattr(module, attr):
        raise ToolConfigError(f"{where}.class_name: module {module_name!r} has no {attr!r}")
    return getattr(module, attr)


# verl's tool classes megappo has its own of: used for their names where verl is not installed
VERL_TOOLS = {"verl.tools.gsm8k_tool.Gsm8kTool": "megappo.tools.Gsm8kTool"}


def tools_from_config(path: str | Path) -> list[Tool]:
    """Instantiate every tool of a tool config YAML (``cls(config=..., tool_schema=...)`` as verl does).
    verl's GSM8K tool, where verl is not installed, is megappo's (VERL_TOOLS)."""
    tools = []
    for spec in read_tool_config(path):
        name = spec.class_name
        if name in VERL_TOOLS and importlib.util.find_spec("verl") is None:
            name = VERL_TOOLS[name]
        cls = import_class(name, spec.where)
        config = resolve_env(spec.config, spec.where + ".config")
        try:
            tool = cls(config=config, tool_schema=spec.tool_schema)
        except Exception as e:
            raise ToolConfigError(f"{spec.where}: {spec.class_name}(config=..., tool_schema=...) failed: "
                                  f"{type(e).__name__}: {e}") from e
        schema = getattr(tool, "tool_schema", None)
        if hasattr(schema, "model_dump"):      # a verl class keeps a pydantic schema
            tool.tool_schema = schema.model_dump(exclude_none=True)
        _check_schema(tool.tool_schema, spec.where)
        tool.name = tool.tool_schema["function"]["name"]
        tools.append(tool)
    return tools


def tools_from_file(path: str | Path) -> list[Tool]:
    """The ``@function_tool`` functions of a Python file, in definition order."""
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise ToolConfigError(f"{path}: file not found")
    name = "megappo_function_tools_" + "_".join(path.with_suffix("").parts[1:]).replace("-", "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module         # lets the file's own dataclasses and pickling find their module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise ToolConfigError(f"{path}: importing it failed: {type(e).__name__}: {e}") from e
    tools = [v.__megappo_tool__ for v in vars(module).values() if hasattr(v, "__megappo_tool__")]
    if not tools:
        raise ToolConfigError(f"{path}: no function is decorated with @megappo.tools.function_tool")
    return tools


def load_tools(tool_config_path: Optional[str] = None, function_tool_path: Optional[str] = None,
               extra: tuple[Tool, ...] = ()) -> dict[str, Tool]:
    """Every tool of both files (and ``extra``) by name; a name given twice is an error."""
    tools = list(extra)
    tools += tools_from_config(tool_config_path) if tool_config_path else []
    tools += tools_from_file(function_tool_path) if function_tool_path else []
    out: dict[str, Tool] = {}
    for t in tools:
        if t.name in out:
            raise ToolConfigError(f"tool name {t.name!r} is defined twice (tool_config_path and function_tool_path "
                                  f"must name each tool once)")
        out[t.name] = t
    return out


def tools_kwargs_of(extra_info: Optional[dict], where: str = "row") -> dict[str, dict]:
    """A row's ``extra_info.tools_kwargs`` (verl's ``{tool: {create_kwargs: {...}}}``), checked.
    Entries that are null are dropped: parquet stores the rows' mappings as one struct column,
    so a row shows every tool any row names, null where it names none."""
    tk = (extra_info or {}).get("tools_kwargs")
    if tk is None:
        return {}
    if not isinstance(tk, dict):
        raise ToolConfigError(f"{where}: extra_info.tools_kwargs: expected a mapping tool -> {{create_kwargs: "
                              f"{{...}}}}, got {type(tk).__name__}")
    out = {}
    for name, entry in tk.items():
        if entry is None:
            continue
        if not isinstance(entry, dict):
            raise ToolConfigError(f"{where}: extra_info.tools_kwargs.{name}: expected a mapping with create_kwargs, "
                                  f"got {type(entry).__name__}")
        create = entry.get("create_kwargs")
        if create is not None and not isinstance(create, dict):
            raise ToolConfigError(f"{where}: extra_info.tools_kwargs.{name}.create_kwargs: expected a mapping of "
                                  f"keyword arguments, got {type(create).__name__}")
        out[name] = {k: v for k, v in entry.items() if v is not None}
    return out

