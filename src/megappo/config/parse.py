"""Values from YAML presets and files and ``a.b.c=value`` overrides, typed by the schema, with
``${a.b.c}`` references resolved and the origin of every value recorded."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml

from megappo.config.schema import ConfigError, PPOConfig, Ref, all_keys
from megappo.config.yamlio import yaml_load
from megappo.config.schema import _is_section, _locate

# ---------------------------------------------------------------------------------------------
# Coercion of override strings and YAML values to the field's type
# ---------------------------------------------------------------------------------------------

MISSING = "???"   # Hydra's marker of a value the user must give

_REF_RE = re.compile(r"^\$\{([A-Za-z0-9_.]+)\}$")
_NULLS = {"null", "none", "~"}
_TRUE = {"true", "yes", "on"}
_FALSE = {"false", "no", "off"}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if tp is dict or origin is dict:
        return "a mapping ({key: value, ...})"
    return {int: "an integer", float: "a number", bool: "a boolean (true/false)", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, from_text: bool) -> Any:
    """Convert ``value`` (override text or YAML scalar/list) to type ``tp``; raise ValueError."""
    if isinstance(value, Ref):
        return value
    if isinstance(value, str) and _REF_RE.match(value.strip()):
        return Ref(_REF_RE.match(value.strip()).group(1))
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and from_text and value.strip().lower() in _NULLS):
            return None
        return _coerce(value, args[0], from_text)
    if value is None or (isinstance(value, str) and from_text and value.strip().lower() in _NULLS and tp is not str):
        raise ValueError(f"null is not allowed here; expected {_type_name(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        v = value.strip() if isinstance(value, str) else value
        if v not in allowed:
            raise ValueError(f"expected {_type_name(tp)}, got {value!r}")
        return v
    if origin is list:
        return _coerce_list(value, tp, from_text)
    if tp is dict or origin is dict:
        return _coerce_mapping(value, from_text)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"expected {_type_name(tp)}, got {value!r}")
    if tp in (int, float):
        return _coerce_number(value, tp, from_text)
    if tp is str:
        if isinstance(value, str):
            v = value.strip() if from_text else value
            if from_text and len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
                v = v[1:-1]
            return v
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"expected a string, got {value!r}")
    raise TypeError(f"unsupported field type {tp}")  # pragma: no cover


def _coerce_list(value: Any, tp: Any, from_text: bool) -> list:
    """A list field: ``[a, b]`` text (YAML), a YAML list, or one value standing for a one-element list."""
    (elem,) = typing.get_args(tp)
    items = value
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                items = yaml.safe_load(text)
            except yaml.YAMLError as e:
                raise ValueError(f"cannot parse {value!r} as a list: {e}") from None
            if not isinstance(items, list):
                raise ValueError(f"expected {_type_name(tp)}, got {value!r}")
            items = [str(x) if from_text and elem is str else x for x in items]
        else:
            items = [text]  # a single value stands for a one-element list, as in verl
    if not isinstance(items, (list, tuple)):
        items = [items]
    out = []
    for x in items:
        try:
            out.append(_coerce(x, elem, from_text))
        except ValueError as e:
            raise ValueError(f"expected {_type_name(tp)}, got {value!r}: {e}") from None
    return out


def _plain(value: Any, where: str) -> Any:
    """``value`` if it is plain data (what YAML and JSON hold), else ValueError naming ``where``."""
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): _plain(v, f"{where}.{k}") for k, v in value.items()}
    raise ValueError(f"{where}: expected plain data (strings, numbers, booleans, null, lists, mappings), "
                     f"got {type(value).__name__}")


def _coerce_mapping(value: Any, from_text: bool) -> dict:
    """A mapping field (arguments handed on to another library): ``{a: 1}`` text (YAML) or a YAML
    mapping; null is the empty mapping. Its entries are set one by one as ``<key>.<entry>=value``."""
    if isinstance(value, str) and from_text:
        try:
            value = yaml_load(value) if value.strip() else None
        except yaml.YAMLError as e:
            raise ValueError(f"cannot parse {value!r} as a mapping: {e}") from None
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping ({{key: value, ...}}), got {value!r}")
    return _plain(value, "value")


def _entry_of_mapping(cfg: PPOConfig, path: str) -> Optional[tuple[dict, list[str]]]:
    """For ``<mapping key>.<entry>[.<entry>...]``: (the mapping field's dict, the entry's path in
    it); None when no leading part of ``path`` is a mapping field."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj, name, tp = _locate(cfg, ".".join(parts[:i]))
        except KeyError:
            continue
        if tp is dict or typing.get_origin(tp) is dict:
            return getattr(obj, name), parts[i:]
        return None
    return None


def _coerce_number(value: Any, tp: Any, from_text: bool):
    """An int or float field (booleans are not numbers; NaN is refused)."""
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer() and not from_text:
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ValueError(f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        out = None
        if isinstance(value, (int, float)):
            out = float(value)
        elif isinstance(value, str):
            try:
                out = float(value.strip())  # YAML 1.1 reads 1e-6 as a string
            except ValueError:
                pass
        if out is None or math.isnan(out):  # NaN passes no comparison: it would slip past every rule
            raise ValueError(f"expected a number, got {value!r}")
        return out


_SELECT_RE = re.compile(r"^\$\{oc\.select:\s*([A-Za-z0-9_.]+)\s*,(.*)\}$", re.S)
_RELATIVE_RE = re.compile(r"\$\{(\.+)([A-Za-z0-9_.]*)\}")


def _omegaconf_forms(cfg: PPOConfig, path: str, value: Any) -> Any:
    """verl's config files write ``${.key}`` (a key of the same section) and
    ``${oc.select:key,default}`` (key's value, or default where key does not exist): the first
    becomes the absolute reference, the second a reference to ``key`` where megappo has it, else
    ``default``."""
    if not isinstance(value, str) or "${" not in value:
        return value
    section = path.split(".")[:-1]

    def absolute(dots: str, rest: str) -> str:
        up = section[:len(section) - (len(dots) - 1)] if len(dots) > 1 else section
        return ".".join(up + ([rest] if rest else []))

    text = value.strip()
    m = _SELECT_RE.match(text)
    if m:
        target, default = m.group(1), m.group(2).strip()
        if target.startswith("."):
            target = absolute(re.match(r"\.+", target).group(0), target.lstrip("."))
        try:
            _locate(cfg, target)
            return "${" + target + "}"
        except KeyError:
            try:
                return yaml.safe_load(default)
            except yaml.YAMLError:
                return default
    return _RELATIVE_RE.sub(lambda r: "${" + absolute(r.group(1), r.group(2)) + "}", value)


def _set(cfg: PPOConfig, path: str, value: Any, from_text: bool) -> None:
    value = _omegaconf_forms(cfg, path, value)
    try:
        obj, name, tp = _locate(cfg, path)
    except KeyError:
        entry = _entry_of_mapping(cfg, path)
        if entry is None:
            raise
        mapping, keys = entry
        if from_text and isinstance(value, str):
            try:
                value = yaml_load(value) if value.strip() else ""
            except yaml.YAMLError:
                value = value.strip()
        for k in keys[:-1]:
            mapping = mapping.setdefault(k, {})
            if not isinstance(mapping, dict):
                raise ValueError(f"'{k}' holds a value, not a mapping") from None
        mapping[keys[-1]] = _plain(value, "value")
        return
    if _is_section(tp):
        if from_text and isinstance(value, str) and value.strip().startswith("{"):   # a YAML mapping: its entries
            try:
                value = yaml_load(value)
            except yaml.YAMLError:
                pass
        if isinstance(value, dict):
            apply_mapping(cfg, value, prefix=path + ".")
            return
        raise ValueError(f"'{path}' is a section; set one of its keys (e.g. '{path}.{dataclasses.fields(tp)[0].name}')")
    try:
        setattr(obj, name, _coerce(value, tp, from_text))
    except ValueError as e:
        raise ValueError(f"{e} (expected {_type_name(tp)})" if "expected" not in str(e) else str(e)) from None


def apply_override(cfg: PPOConfig, text: str) -> None:
    """Apply one verl-style override ``a.b.c=value`` (a leading ``+``/``++`` is accepted)."""
    if "=" not in text:
        raise ValueError(f"override {text!r} is not of the form key=value")
    key, value = text.split("=", 1)
    key = key.strip().lstrip("+")
    key = _renamed(key)
    try:
        _set(cfg, key, value, from_text=True)
    except KeyError as e:
        raise KeyError(e.args[0]) from None
    except ValueError as e:
        raise ValueError(f"{key}={value}: {e}") from None


def _renamed(path: str) -> str:
    """megappo's key for a verl key that names one of its settings differently (verl_keys.RENAMED)."""
    from megappo.config import verl_keys

    path = verl_keys.RENAMED.get(path, path)
    m = _FLAT_OVERRIDE.match(path)
    if m and m.group(2).split(".")[0] not in ("model_config", "moe_config"):
        # verl's new model engine reads override_config's own entries as config.json's (its
        # legacy Megatron worker only model_config's): 20 of its scripts set them so
        return f"{m.group(1)}.override_config.model_config.{m.group(2)}"
    return path


_FLAT_OVERRIDE = re.compile(r"^(actor_rollout_ref\.model|critic\.model)\.override_config\.(.+)$")


def _verl_key(path: str, value: Any, errors: Optional[list], warnings: Optional[list]) -> bool:
    """A key with no field here that verl knows (megappo.config.verl_keys): record its warning or error
    and return True; False when verl does not know it either."""
    from megappo.config import verl_keys

    if isinstance(value, dict):  # a nested mapping under an unknown section: judge its leaves
        leaves = {f"{path}.{k}": v for k, v in value.items() if v != MISSING}
        if not all(verl_keys.check(p, v) is not None or isinstance(v, dict) for p, v in leaves.items()):
            return False
        return all(_verl_key(p, v, errors, warnings) for p, v in leaves.items())
    got = verl_keys.check(path, value)
    if got is None:
        return False
    kind, msg = got
    if kind == "warn" and warnings is not None:
        warnings.append(msg)
    elif kind == "error":
        if errors is None:
            raise ValueError(f"{path}: {msg}")
        errors.append((path, msg))
    return True


def apply_mapping(cfg: PPOConfig, mapping: dict, prefix: str = "", errors: Optional[list] = None,
                  set_paths: Optional[list] = None, warnings: Optional[list] = None) -> None:
    """Apply a (nested or dotted) mapping, e.g. a parsed YAML preset; the key paths set are
    appended to ``set_paths``. verl keys with no field here: see megappo.config.verl_keys."""
    from megappo.config import verl_keys

    for k, v in mapping.items():
        if v == MISSING:   # Hydra's "required, not given" in verl's own files: megappo's default stands
            continue
        path = _renamed(prefix + str(k))
        try:
            try:
                obj, name, tp = _locate(cfg, path)
            except KeyError:
                if _entry_of_mapping(cfg, path) is None:
                    raise
                obj, name, tp = None, None, None    # an entry of a mapping key
            if tp is None:
                _set(cfg, path, v, from_text=False)
            elif _is_section(tp) and isinstance(v, dict):
                apply_mapping(cfg, v, prefix=path + ".", errors=errors, set_paths=set_paths, warnings=warnings)
                continue
            else:
                if (tp is dict or typing.get_origin(tp) is dict) and isinstance(v, dict):   # files merge, as Hydra's
                    v = {**getattr(obj, name), **v}
                _set(cfg, path, verl_keys.substitute(path, v, warnings), from_text=False)
            if set_paths is not None:
                set_paths.append(path)
        except (KeyError, ValueError) as e:
            if isinstance(e, KeyError) and _verl_key(path, v, errors, warnings):
                continue
            if errors is None:
                raise
            msg = e.args[0] if isinstance(e, KeyError) else str(e)
            errors.append((path, msg))


# ---------------------------------------------------------------------------------------------
# ${...} resolution
# ---------------------------------------------------------------------------------------------

_TMPL_RE = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")


def _resolve(cfg: PPOConfig, errors: list[tuple[str, str]]) -> None:
    done: dict[str, Any] = {}

    def value_of(path: str, stack: tuple[str, ...]) -> Any:
        if path in done:
            return done[path]
        if path in stack:
            raise ValueError("circular reference: " + " -> ".join(stack + (path,)))
        obj, name, tp = _locate(cfg, path)
        if _is_section(tp):
            raise ValueError(f"'${{{path}}}' refers to a section, not a value")
        v = getattr(obj, name)
        if isinstance(v, Ref):
            target = value_of(v.path, stack + (path,))
            v = _coerce(target, tp, from_text=False)
        elif isinstance(v, str) and "${" in v:
            v = _TMPL_RE.sub(lambda m: str(value_of(m.group(1), stack + (path,))), v)
        setattr(obj, name, v)
        done[path] = v
        return v

    for key in all_keys():
        try:
            value_of(key, ())
        except (KeyError, ValueError) as e:
            errors.append((key, e.args[0] if isinstance(e, KeyError) else str(e)))
            done[key] = None

    def in_mapping(v: Any, where: str) -> Any:   # ${a.b} inside a mapping key's values
        if isinstance(v, dict):
            return {k: in_mapping(x, f"{where}.{k}") for k, x in v.items()}
        if isinstance(v, list):
            return [in_mapping(x, f"{where}[{i}]") for i, x in enumerate(v)]
        if isinstance(v, str) and "${" in v:
            whole = _REF_RE.match(v.strip())
            return value_of(whole.group(1), (where,)) if whole else _TMPL_RE.sub(
                lambda m: str(value_of(m.group(1), (where,))), v)
        return v

    for key in all_keys():
        obj, name, tp = _locate(cfg, key)
        if tp is dict or typing.get_origin(tp) is dict:
            try:
                setattr(obj, name, in_mapping(getattr(obj, name), key))
            except (KeyError, ValueError) as e:
                errors.append((key, e.args[0] if isinstance(e, KeyError) else str(e)))


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

PRESETS_DIR = Path(__file__).parent.parent / "presets"


def _preset_path(name: str) -> Path:
    p = Path(os.path.expanduser(name))
    if p.suffix in (".yaml", ".yml") or p.exists() or os.sep in name:
        return p
    return PRESETS_DIR / f"{name}.yaml"


def _yaml_error(path: Path, e: yaml.YAMLError) -> str:
    """One line naming the file, the line and column YAML points at, and what it expected."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is None or not problem:
        return f"cannot parse '{path}' as YAML: {' '.join(str(e).split())}"
    msg = f"cannot parse '{path}' as YAML: line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context:
        msg += f" ({context}" + (f" started at line {cmark.line + 1}" if cmark is not None else "") + ")"
    return msg


def _yaml_key_lines(text: str) -> dict[str, int]:
    """1-based line of every (dotted) key path in a YAML mapping, for error messages."""
    lines: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode):
                path = prefix + str(k.value)
                lines.setdefault(path, k.start_mark.line + 1)
                walk(v, path + ".")

    try:
        walk(yaml.compose(text, Loader=yaml.SafeLoader), "")
    except yaml.YAMLError:  # pragma: no cover - the file parsed a moment ago
        pass
    return lines


def _read_yaml(path: Path, errors: list) -> Optional[tuple[dict, dict[str, int]]]:
    """(mapping, {key path: line}) of a config file; problems go to ``errors``."""
    if not path.is_file():
        known = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
        errors.append(("--config", f"config file '{path}' not found (built-in presets: {', '.join(known)})"))
        return None
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        errors.append(("--config", f"cannot parse '{path}': line {line} is not UTF-8 text "
                                   f"(byte 0x{raw[e.start]:02x} at offset {e.start})"))
        return None
    try:
        data = yaml_load(text)
    except yaml.YAMLError as e:
        errors.append(("--config", _yaml_error(path, e)))
        return None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        errors.append(("--config", f"'{path}' must hold a mapping of config keys, got {type(data).__name__}"))
        return None
    if not _hydra_header_ok(data, path, errors):
        return None
    return data, _yaml_key_lines(text)


VERL_TRAINER_CONFIGS = ("ppo_trainer", "ppo_megatron_trainer")


def _hydra_header_ok(data: dict, path: Path, errors: list) -> bool:
    """A verl config file's Hydra header: ``defaults`` naming verl's trainer config (whose
    defaults megappo's are) and ``_self_``, and ``hydra`` (its search path), are read and dropped
    from ``data``; any other defaults entry is an error naming it."""
    data.pop("hydra", None)
    defaults = data.pop("defaults", None)
    if defaults is None:
        return True
    for entry in defaults if isinstance(defaults, list) else [defaults]:
        if entry not in VERL_TRAINER_CONFIGS + ("_self_",):
            errors.append(("--config", f"'{path}': defaults entry {entry!r} is not supported: megappo reads verl "
                                       f"config files whose defaults are verl's trainer config "
                                       f"({' or '.join(VERL_TRAINER_CONFIGS)}) and _self_"))
            return False
    return True


def load_config(
    overrides: tuple[str, ...] | list[str] = (),
    config_files: tuple[str, ...] | list[str] = (),
    *,
    raise_errors: bool = True,
    errors: Optional[list] = None,
    sources: Optional[dict] = None,
    warnings: Optional[list] = None,
) -> PPOConfig:
    """Defaults <- each YAML in ``config_files`` (paths or built-in preset names) <- overrides.

    All problems are collected; with ``raise_errors`` a single :class:`ConfigError` lists them.
    ``sources`` (when given) receives, per key path set, where its value came from;
    ``warnings`` the one-line warnings of accepted verl keys that have no effect here.
    """
    from megappo.config import verl_keys

    errs: list[tuple[str, str]] = [] if errors is None else errors
    src: dict = {} if sources is None else sources
    cfg = PPOConfig()
    for name in config_files:
        path = _preset_path(name)
        read = _read_yaml(path, errs)
        if read is not None:
            data, lines = read
            sub: list = []
            done: list = []
            apply_mapping(cfg, data, errors=sub, set_paths=done, warnings=warnings)
            errs += [(k, f"{m} (in {path}" + (f", line {lines[k]})" if k in lines else ")")) for k, m in sub]
            where = f"preset {name}" if path.parent == PRESETS_DIR and name == path.stem else str(path)
            src.update((k, where) for k in done)
    for text in overrides:
        if _mapping_override(cfg, text, errs, src, warnings):
            continue
        try:
            if "=" in text:
                key, value = text.split("=", 1)
                text = f"{key}={verl_keys.substitute(key.strip().lstrip('+'), value, warnings)}"
            apply_override(cfg, text)
            src[_renamed(text.split("=", 1)[0].strip().lstrip("+"))] = "the command line"
        except KeyError as e:
            key, value = (x.strip() for x in text.split("=", 1))
            if not _verl_key(key.lstrip("+"), value, errs, warnings):
                errs.append((key.lstrip("+"), e.args[0]))
        except ValueError as e:
            key = text.split("=", 1)[0].strip().lstrip("+") if "=" in text else ""
            errs.append((key, str(e).split(": ", 1)[-1] if key else str(e)))
    _resolve(cfg, errs)
    method_defaults(cfg, src)
    if errs and raise_errors:
        raise ConfigError(errs)
    return cfg


def _mapping_override(cfg: PPOConfig, text: str, errs: list, src: dict, warnings) -> bool:
    """``section={key: value, ...}`` on the command line: applied entry by entry as a file's
    mapping, each entry's errors and origin its own. False when ``text`` is not that."""
    key, _, value = text.partition("=")
    key = _renamed(key.strip().lstrip("+"))
    if not value.strip().startswith("{"):
        return False
    try:
        _, _, tp = _locate(cfg, key)
        data = yaml_load(value)
    except (KeyError, yaml.YAMLError):
        return False
    if not _is_section(tp) or not isinstance(data, dict):
        return False
    done: list = []
    apply_mapping(cfg, {key: data}, errors=errs, set_paths=done, warnings=warnings)
    src.update((k, "the command line") for k in done)
    return True


# PPO with a critic and several samples per prompt: what a key left unset means (measured in
# docs/benchmarks.md, "PPO with a critic: the defaults"). The advantages are GRPO's with the
# critic's per-token correction weighted by the evidence for it (group_cv: never worse than
# GRPO beyond the seeds' spread, and no collapse); the critic's Adam keeps a short second-moment
# memory (~20 steps instead of ~1,000: the large early errors would keep its later steps small).
# The critic makes one pass per batch, as verl's: 8 passes learnt per-token credit sooner but made
# a step ~3.5x GRPO's for at most 11% fewer samples, a loss in seconds on every task measured.
GAE_GROUP_DEFAULTS = {
    "algorithm.gae_adv_norm": "group_cv",
    "critic.optim.betas": [0.9, 0.95],
}


def method_defaults(cfg: PPOConfig, sources: dict) -> list[str]:
    """Fill the keys whose default depends on the method, where nobody set them: with
    ``algorithm.gae_adv_norm=auto`` (its default) and ``adv_estimator=gae`` with
    ``rollout.n > 1`` (and one lambda: VAPO's ``lam_length_alpha`` keeps batch whitening), every
    key of :data:`GAE_GROUP_DEFAULTS` not set by a file or the command line takes its value there;
    otherwise ``auto`` means ``batch`` (verl's whitening). Returns the keys filled."""
    al = cfg.algorithm
    if al.gae_adv_norm != "auto":
        return []
    n = cfg.actor_rollout_ref.rollout.n
    grouped = (al.adv_estimator == "gae" and isinstance(n, int) and n > 1 and al.lam_length_alpha is None)
    al.gae_adv_norm = "batch"
    if not grouped:
        return []
    unset = lambda key: source_of(sources, key) == "the defaults"
    filled = []
    for key, value in GAE_GROUP_DEFAULTS.items():
        if key == "algorithm.gae_adv_norm" or unset(key):
            obj, name, _ = _locate(cfg, key)
            setattr(obj, name, list(value) if isinstance(value, list) else value)
            sources[key] = "the defaults of adv_estimator=gae with rollout.n > 1"
            filled.append(key)
    return filled


def source_of(sources: dict, path: str) -> str:
    """Where the value of ``path`` came from (see load_config's ``sources``): the command line,
    a preset or YAML file, or the defaults (verl's, or a reference to another key)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in sources:
            return sources[".".join(parts[:i])]
    entries = [k for k in sources if k.startswith(path + ".")]   # a mapping set entry by entry
    return sources[entries[0]] if entries else "the defaults"


def to_dict(cfg: Any) -> dict:
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = to_dict(v)
        elif isinstance(v, Ref):
            out[f.name] = str(v)
        elif isinstance(v, dict):
            out[f.name] = dict(v)
        else:
            out[f.name] = list(v) if isinstance(v, (list, tuple)) else v
    return out


def to_yaml(cfg: PPOConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None, width=100)



def verl_compat(text: str) -> tuple[str, str, str]:
    """What one verl override ``key=value`` becomes here: (status, key, what), status one of
    ``set`` (a megappo key of the same name), ``mapped`` (another megappo key), ``accepted``,
    ``warned``, ``refused`` (with the reason) or ``unknown``."""
    from megappo.config import verl_keys

    if "=" not in text:
        return "refused", text, "not of the form key=value"
    key, value = (x.strip() for x in text.split("=", 1))
    key = key.lstrip("+")
    target = _renamed(key)
    said: list = []
    ours = verl_keys.substitute(target, value, said)
    try:
        apply_override(PPOConfig(), f"{target}={ours}")
        if said:
            return "warned", key, said[0]
        return ("mapped", key, f"sets {target}") if target != key else ("set", key, "a megappo key")
    except ValueError as e:
        return "refused", key, str(e).split(": ", 1)[-1]
    except KeyError as e:
        got = verl_keys.check(key, value)
        if got is None:
            return "unknown", key, e.args[0]
        kind, msg = got
        return {"ok": "accepted", "warn": "warned", "error": "refused"}[kind], key, msg or "what megappo does anyway"
