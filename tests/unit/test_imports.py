"""The import structure of src/megappo: no import cycles between its parts (a package or a
top-level module; imports inside functions count too), and one public face per package (code
outside a package imports what its ``__init__`` exports, never a submodule's private names or
names the package does not export)."""
import ast
from collections import defaultdict
from pathlib import Path

import megappo

SRC = Path(megappo.__file__).resolve().parent          # src/megappo


def _modules() -> dict[str, Path]:
    out = {}
    for p in SRC.rglob("*.py"):
        parts = p.relative_to(SRC.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = _modules()
PACKAGES = {m for m, p in MODULES.items() if p.name == "__init__.py"}


def _imports(module: str, path: Path):
    """(line, imported module, names) for every import of megappo in ``module``, relative ones resolved."""
    pkg = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "megappo":
                    yield node.lineno, a.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.split(".")[0] == "megappo":
                yield node.lineno, name, [a.name for a in node.names]


def _part(module: str) -> str:
    """The part a module belongs to: its top-level package, or itself for a top-level module."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def _targets(name: str, names: list) -> list[str]:
    """The modules an import reaches: each imported name that is a submodule, else the module."""
    subs = [f"{name}.{n}" for n in names if f"{name}.{n}" in MODULES]
    return subs or ([name] if name in MODULES else [])


def _cycles(edges: dict) -> list[list[str]]:
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                out.append(sorted(scc))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_between_parts_or_modules():
    parts, modules, why = defaultdict(set), defaultdict(set), defaultdict(list)
    for module, path in MODULES.items():
        for line, name, names in _imports(module, path):
            for target in _targets(name, names):
                if target != module:
                    modules[module].add(target)
                a, b = _part(module), _part(target)
                if a != b and b != "megappo":
                    parts[a].add(b)
                    why[(a, b)].append(f"{path.relative_to(SRC.parent)}:{line} imports {target}")
    report = []
    for scc in _cycles(parts):
        report.append(" <-> ".join(scc) + ": " + "; ".join(w for a in scc for b in scc for w in why.get((a, b), [])[:2]))
    assert not report, "import cycles between parts of megappo:\n" + "\n".join(report)
    assert not _cycles(modules), f"import cycles between modules: {_cycles(modules)}"


def test_packages_are_used_through_their_public_face():
    import importlib

    bad = []
    for module, path in MODULES.items():
        for line, name, names in _imports(module, path):
            pkg = _part(name)
            if name == "megappo" or pkg not in PACKAGES or _part(module) == pkg:
                continue
            public = set(getattr(importlib.import_module(pkg), "__all__", ()))
            where = f"{path.relative_to(SRC.parent)}:{line}"
            if name != pkg:
                bad.append(f"{where}: imports {name} (use {pkg}'s public names)")
            else:
                bad += [f"{where}: {pkg} does not export {n}" for n in names if n not in public]
    assert not bad, "imports past a package's public face:\n" + "\n".join(bad)


def test_no_package_exports_a_private_name():
    import importlib

    bad = [f"{pkg}: {n}" for pkg in sorted(PACKAGES) for n in getattr(importlib.import_module(pkg), "__all__", ())
           if n.startswith("_")]
    assert not bad, bad


def test_functions_stay_readable():
    """No function in src/megappo over 80 lines, and the trainer's class stays a loop (<= 250 lines)."""
    long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 80:
                long.append(f"{path.relative_to(SRC.parent)}:{node.lineno} {node.name} "
                            f"({node.end_lineno - node.lineno + 1} lines)")
    assert not long, long
    tree = ast.parse((SRC / "trainer" / "ppo.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PPOTrainer")
    assert cls.end_lineno - cls.lineno + 1 <= 250


def test_trainer_attributes_are_born_in_init():
    """Every attribute PPOTrainer sets is set in __init__ first (a reader finds them all there)."""
    tree = ast.parse((SRC / "trainer" / "ppo.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PPOTrainer")

    def assigned(fn):
        return {t.attr for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                for t in (t.elts if isinstance(t, ast.Tuple) else [t])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}

    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    born = assigned(methods.pop("__init__"))
    late = {f"{name}: self.{a}" for name, fn in methods.items() for a in assigned(fn) - born}
    assert not late, sorted(late)
