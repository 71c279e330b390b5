"""The configuration reference: a markdown table of every key, generated from the dataclasses.
Its copy lives in ``docs/configuration.md`` between the ``config-reference`` markers;
``python -m megappo.config`` rewrites it there and a test checks it is current."""
from __future__ import annotations

import dataclasses
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from megappo.config.schema import PPOConfig, Ref
from megappo.config.schema import _hints, _is_section

# ---------------------------------------------------------------------------------------------
# Reference documentation (docs/configuration.md's table is generated from this and checked by a test)
# ---------------------------------------------------------------------------------------------

def _short_type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " \\| ".join(str(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_short_type(a) for a in typing.get_args(tp) if a is not type(None)) + " or null"
    if origin is list:
        return f"list[{_short_type(typing.get_args(tp)[0])}]"
    if tp is dict or origin is dict:
        return "mapping"
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


# The reference's copy in the documentation, between these markers.
REFERENCE_START = "<!-- config-reference:start -->"
REFERENCE_END = "<!-- config-reference:end -->"
# docs/configuration.md of the repository this package is imported from (src/megappo/config/docs.py)
REFERENCE_DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def _marked(text: str) -> "re.Match[str] | None":
    return re.search(rf"{re.escape(REFERENCE_START)}\n(.*?)\n?{re.escape(REFERENCE_END)}", text, re.S)


def reference_in(text: str) -> "str | None":
    """The table between the reference markers of ``text``; None when it has no markers."""
    m = _marked(text)
    return m.group(1).strip() if m else None


def with_reference(text: str, table: "str | None" = None) -> str:
    """``text`` with the table between its reference markers replaced by ``table`` (default: the
    current reference). Raises ValueError when ``text`` has no markers."""
    m = _marked(text)
    if m is None:
        raise ValueError(f"no {REFERENCE_START} ... {REFERENCE_END} markers")
    table = (config_reference_markdown() if table is None else table).strip()
    return text[:m.start()] + f"{REFERENCE_START}\n{table}\n{REFERENCE_END}" + text[m.end():]

