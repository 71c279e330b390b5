"""YAML read as OmegaConf (verl's config library) reads it, for config files and values."""
from __future__ import annotations

import re

import yaml

__all__ = ["yaml_load"]


class _Loader(yaml.SafeLoader):
    """YAML as OmegaConf (verl's config library) reads it: YAML 1.2's floats (``1e-3`` is a
    number, not text) and booleans (only true/false: ``on``, ``yes``, ``no`` stay text)."""


_Loader.yaml_implicit_resolvers = {
    k: [(tag, regexp) for tag, regexp in v if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:float")]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)"
               r"|\.[0-9_]+(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def yaml_load(text: str):
    """``text`` parsed as OmegaConf parses YAML (see _Loader)."""
    return yaml.load(text, Loader=_Loader)
