"""The configuration reference (the README's table is generated from it and checked by a test)."""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

import yaml

from megappo.config.schema import PPOConfig, Ref, _hints, _is_section

# ---------------------------------------------------------------------------------------------
# Reference documentation (the README's table is generated from this and checked by a test)
# ---------------------------------------------------------------------------------------------

def _short_type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " \\| ".join(str(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_short_type(a) for a in typing.get_args(tp) if a is not type(None)) + " or null"
    if origin is list:
        return f"list[{_short_type(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def _fmt_default(v: Any) -> str:
    if isinstance(v, Ref):
        return f"`{v}`"
    if isinstance(v, str):
        return f"`{v}`"
    if v is None:
        return "`null`"
    if isinstance(v, bool):
        return "`true`" if v else "`false`"
    if isinstance(v, float) and (v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5)):
        return f"`{v:g}`"
    return f"`{yaml.safe_dump(v, default_flow_style=True).strip()}`" if isinstance(v, list) else f"`{v}`"


def config_reference_markdown() -> str:
    """A markdown table of every key: path, type, default, meaning."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            tp = _hints(type(obj))[f.name]
            v = getattr(obj, f.name)
            if _is_section(tp):
                walk(v, prefix + f.name + ".")
                continue
            t = _short_type(tp)
            rows.append(f"| `{prefix}{f.name}` | {t} | {_fmt_default(v)} | {f.metadata.get('help', '')} |")

    walk(PPOConfig(), "")
    return "\n".join(rows)

