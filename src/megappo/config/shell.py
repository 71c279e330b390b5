"""A verl launch script's overrides as the shell would pass them, for ``--verl-compat``: verl's
scripts set their values in shell variables first (``max_response_length=$((1024 * 8))``,
``data.train_files="$train_files"``, ``${NNODES:-1}``); read literally, each ``$name`` would be
refused as a bad value. Variables assigned in the script (in order, ``export`` or not), the
``${name:-default}`` forms and integer ``$(( ))`` arithmetic are expanded, unset ones from the
environment; what only running the script could tell (``$(command)``, a loop's variable) stays
as written and is reported as unchecked."""
from __future__ import annotations

import re
import shlex
from typing import Mapping, Optional

__all__ = ["script_overrides", "expand"]

_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_]\w*)=(.*)$", re.S)
_NAME = re.compile(r"[A-Za-z_]\w*")
_KEY = re.compile(r"[A-Za-z_][\w.]*")   # an override's key (not python -c "import x; f(a=b)")


def _closing(text: str, start: int, opening: str = "(", closing: str = ")", depth: int = 1) -> Optional[int]:
    """Index just past the bracket closing the ``depth`` open ones before ``start`` (nesting counted)."""
    for i in range(start, len(text)):
        depth += (text[i] == opening) - (text[i] == closing)
        if depth == 0:
            return i + 1
    return None


def _arithmetic(expr: str, env: Mapping[str, str]) -> Optional[str]:
    """bash's integer $(( )): names and $names are variables (unset: 0), / truncates."""
    expr = re.sub(r"\$\{?([A-Za-z_]\w*)\}?", r"\1", expr)
    values = {}
    for name in set(_NAME.findall(expr)):
        v = env.get(name, "0") or "0"
        if not re.fullmatch(r"-?\d+", v.strip()):
            return None
        values[name] = v.strip()
    py = _NAME.sub(lambda m: f"({values[m.group(0)]})", expr).replace("/", "//")
    if not re.fullmatch(r"[\d\s+\-*/%()]*", py):
        return None
    try:
        return str(int(eval(py, {"__builtins__": {}}, {})))   # digits and operators only (checked above)
    except (SyntaxError, ZeroDivisionError, ValueError, TypeError):
        return None


def expand(text: str, env: Mapping[str, str]) -> str:
    """``text`` with the expansions the module's docstring lists; the others left as written."""
    out, i = [], 0
    while i < len(text):
        if text[i] != "$":
            out.append(text[i])
            i += 1
            continue
        if text.startswith("$((", i):
            end = _closing(text, i + 3, depth=2)
            value = _arithmetic(text[i + 3:end - 2], env) if end is not None else None
            out.append(value if value is not None else text[i:end or len(text)])
            i = end or len(text)
        elif text.startswith("${", i):
            end = _closing(text, i + 2, "{", "}") or len(text)
            body = text[i + 2:end - 1]
            m = re.fullmatch(r"([A-Za-z_]\w*|\d+)(?::?[-=](.*))?", body, re.S)   # $1: unset (no arguments)
            if m is None:
                out.append(text[i:end])
            elif env.get(m.group(1)):
                out.append(env[m.group(1)])
            elif m.group(2) is not None:
                out.append(expand(m.group(2), env))
            else:
                out.append(text[i:end] if m.group(1) not in env else "")
            i = end
        else:
            m = _NAME.match(text, i + 1)
            if m and m.group(0) in env:
                out.append(env[m.group(0)])
                i = m.end()
            else:
                out.append("$")
                i += 1
    return "".join(out)


def script_overrides(text: str, environ: Mapping[str, str]) -> list[str]:
    """The ``key=value`` words of a verl launch script (dotted keys, and verl's ``model_engine``),
    expanded as the module's docstring says. ``environ``: the variables the script does not set."""
    env = dict(environ)
    words, pending = [], ""
    for line in text.replace("\\\n", " ").splitlines():
        if not pending and line.lstrip().startswith("#"):
            continue
        line = pending + line
        try:   # a quoted value may span lines (ROLLOUT_CONFIG="<newline> key=value ...")
            shlex.split(line, comments=True)
        except ValueError:
            pending = line + "\n"
            continue
        pending = ""
        m = _ASSIGN.match(line)
        expanded = expand(m.group(2) if m else line, env)
        try:
            parts = shlex.split(expanded, comments=True)
        except ValueError:   # a value that brought an unbalanced quote: split it as words
            parts = expanded.split()
        if m and len(parts) <= 1:
            env[m.group(1)] = parts[0] if parts else ""
        else:   # a command (NAME=value command ...: the variable is the command's alone)
            words += parts[1:] if m else parts
    keys = [(w, w.split("=", 1)[0].lstrip("+")) for w in words if "=" in w]
    return [w for w, k in keys if _KEY.fullmatch(k) and ("." in k or k in ("model_engine",))]
