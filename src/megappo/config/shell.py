"""A verl launch script's overrides as the shell would pass them, for ``--verl-compat``: verl's
scripts set their values in shell variables first (``max_response_length=$((1024 * 8))``,
``data.train_files="$train_files"``, ``${NNODES:-1}``); read literally, each ``$name`` would be
refused as a bad value. Variables assigned in the script (in order, ``export`` or not, several per
line), the ``${name:-default}`` / ``${name-default}`` / ``${name:=default}`` forms and integer
``$(( ))`` arithmetic are expanded as bash does (not inside single quotes; ``\\$`` is a dollar),
unset ones from the environment; what only running the script could tell (``$(command)``, a loop's
variable, which branch of an ``if`` runs: both are read, in order) stays as written and is
reported as unchecked. Here-documents are not read."""
from __future__ import annotations

import ast
import re
import shlex
from typing import Mapping, MutableMapping, Optional

__all__ = ["script_overrides", "expand"]

_NAME = re.compile(r"[A-Za-z_]\w*")
_ASSIGNMENT = re.compile(r"([A-Za-z_]\w*)=(.*)", re.S)
_KEY = re.compile(r"[A-Za-z_][\w.]*")   # an override's key (not python -c "import x; f(a=b)")


def _closing(text: str, start: int, opening: str = "(", closing: str = ")", depth: int = 1) -> Optional[int]:
    """Index just past the bracket closing the ``depth`` open ones before ``start`` (nesting counted)."""
    for i in range(start, len(text)):
        depth += (text[i] == opening) - (text[i] == closing)
        if depth == 0:
            return i + 1
    return None


def _integer(node) -> int:
    """bash's integer arithmetic on a parsed expression: / and % truncate toward zero."""
    if isinstance(node, ast.Expression):
        return _integer(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _integer(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp):
        a, b = _integer(node.left), _integer(node.right)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)):
            q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)   # ZeroDivisionError when b is 0
            return q if not isinstance(node.op, ast.Mod) else a - b * q
    raise ValueError("not integer arithmetic")


def _arithmetic(expr: str, env: Mapping[str, str]) -> Optional[str]:
    """bash's integer $(( )): names and $names are variables (unset or empty: 0)."""
    expr = re.sub(r"\$\{?([A-Za-z_]\w*)\}?", r"\1", expr)
    values = {}
    for name in set(_NAME.findall(expr)):
        v = (env.get(name) or "0").strip()
        if not re.fullmatch(r"-?\d+", v):
            return None
        values[name] = v
    py = _NAME.sub(lambda m: f"({values[m.group(0)]})", expr)
    try:
        return str(_integer(ast.parse(py.strip(), mode="eval")))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def expand(text: str, env: MutableMapping[str, str]) -> str:
    """``text`` with the expansions the module's docstring lists; the others left as written.
    ``${name:=default}`` assigns in ``env``."""
    quoting, out, i = _quoting(text), [], 0
    while i < len(text):
        c, single = text[i], quoting[i] == "'"
        if c == "\\" and not single and i + 1 < len(text) and text[i + 1] == "$":
            out.append("$")   # a literal dollar (left for the caller's unchecked test to see)
            i += 2
            continue
        if c != "$" or single:
            out.append(c)
            i += 1
            continue
        if text.startswith("$((", i):
            end = _closing(text, i + 3, depth=2)
            value = _arithmetic(expand(text[i + 3:end - 2], env), env) if end is not None else None
            out.append(value if value is not None else text[i:end or len(text)])
            i = end or len(text)
        elif text.startswith("${", i):
            end = _closing(text, i + 2, "{", "}") or len(text)
            out.append(_braced(text[i:end], env))
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


def _braced(whole: str, env: MutableMapping[str, str]) -> str:
    """``${...}``: a variable, or one with a default (``:-`` unset or empty, ``-`` unset; ``=`` forms assign)."""
    m = re.fullmatch(r"([A-Za-z_]\w*|\d+)(?:(:?)([-=])(.*))?", whole[2:-1], re.S)   # $1: unset (no arguments)
    if m is None:
        return whole
    name, colon, op, default = m.groups()
    value = env.get(name)
    if op is None:
        return value if value is not None else whole
    if value is not None and (value or not colon):
        return value
    value = expand(default, env)
    if op == "=":
        env[name] = value
    return value


def _quoting(text: str) -> list[str]:
    """For each character of ``text``: the quote it is inside ("'" or '"'; a quote mark counts as
    inside its own quotes), or "" outside quotes."""
    out, open_ = [], ""
    for c in text:
        if c in "'\"" and open_ in ("", c):
            open_ = "" if open_ else c
            out.append(c)
        else:
            out.append(open_)
    return out


def _strip_comment(line: str) -> str:
    """The line up to a ``#`` that starts a word outside quotes (bash's comment)."""
    quoting = _quoting(line)
    for i, c in enumerate(line):
        if c == "#" and not quoting[i] and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def _commands(line: str) -> list[str]:
    """The line split at ``;``, ``&&`` and ``||`` outside quotes."""
    quoting, out, start, i = _quoting(line), [], 0, 0
    while i < len(line):
        if not quoting[i] and (line[i] == ";" or line.startswith(("&&", "||"), i)):
            out.append(line[start:i])
            i += 1 if line[i] == ";" else 2
            start = i
            continue
        i += 1
    return out + [line[start:]]


def script_overrides(text: str, environ: Mapping[str, str]) -> list[str]:
    """The ``key=value`` words of a verl launch script (dotted keys, and verl's ``model_engine``),
    expanded as the module's docstring says. ``environ``: the variables the script does not set."""
    env = dict(environ)
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    words, pending = [], ""
    for raw in "\n".join(lines).replace("\\\n", " ").splitlines():
        line = _strip_comment(pending + raw)
        try:   # a quoted value may span lines (ROLLOUT_CONFIG="<newline> key=value ...")
            shlex.split(line)
        except ValueError:
            pending = pending + raw + "\n"
            continue
        pending = ""
        for command in _commands(line):
            words += _run(command, env)
    keys = [(w, w.split("=", 1)[0].lstrip("+")) for w in words if "=" in w]
    return [w for w, k in keys if _KEY.fullmatch(k) and ("." in k or k in ("model_engine",))]


def _run(command: str, env: MutableMapping[str, str]) -> list[str]:
    """One simple command: its leading ``NAME=value`` words assign (the script's variables when
    nothing follows them, or ``export`` does; otherwise the command's own); the rest are its words."""
    expanded = expand(command, env)
    try:
        parts = shlex.split(expanded)
    except ValueError:   # a value that brought an unbalanced quote: split it as words
        parts = expanded.split()
    exported = parts[:1] == ["export"]
    parts = parts[1:] if exported else parts
    n = 0
    while n < len(parts) and _ASSIGNMENT.fullmatch(parts[n]):
        n += 1
    if n == len(parts) or exported:
        for word in parts[:n]:
            name, value = _ASSIGNMENT.fullmatch(word).groups()
            env[name] = value
        return [] if n == len(parts) else parts[n:]
    return parts[n:]
