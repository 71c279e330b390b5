"""Every config field has a reader in the program: a key that validates and is documented but
that nothing reads would silently do nothing (a review once found ~20 such keys).

The check reads the source: attribute chains from the config (``cfg.critic.ppo_mini_batch_size``,
``self.cfg...``) through local aliases (``arr = cfg.actor_rollout_ref``, tuple assignments,
conditional expressions) and parameters annotated with a config section type. The validation and
parsing code in the megappo/config package do not count as readers; its helpers that the program
calls (critic_enabled, parallel_layout) do."""
import ast
import dataclasses
from pathlib import Path

from megappo import config as C
from megappo.config import schema as S

SRC = Path(C.__file__).resolve().parent.parent          # src/megappo
CONFIG_HELPERS = {"critic_enabled", "parallel_layout"}   # megappo.config functions the trainer calls


def _section_paths() -> dict[str, list[str]]:
    """Section dataclass name -> its key paths (a class may sit in several places)."""
    out: dict[str, list[str]] = {}

    def walk(cls, prefix):
        out.setdefault(cls.__name__, []).append(prefix.rstrip("."))
        for f in dataclasses.fields(cls):
            tp = S._hints(cls)[f.name]
            if S._is_section(tp):
                walk(tp, prefix + f.name + ".")

    walk(C.PPOConfig, "")
    return out


def _chain(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return list(reversed(parts + [node.id])) if isinstance(node, ast.Name) else None


def _reads(tree: ast.AST, sections: dict) -> set[str]:
    found: set[str] = set()

    def resolve(chain, alias):
        if chain[:2] == ["self", "cfg"]:
            bases, rest = [""], chain[2:]
        elif chain[0] == "cfg":
            bases, rest = [""], chain[1:]
        elif chain[0] in alias:
            bases, rest = alias[chain[0]], chain[1:]
        else:
            return []
        return [".".join(p for p in [b, *rest] if p) for b in bases]

    def value_paths(v, alias):
        if isinstance(v, ast.IfExp):
            return value_paths(v.body, alias) + value_paths(v.orelse, alias)
        c = _chain(v)
        return resolve(c, alias) if c else []

    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        alias: dict[str, list[str]] = {}
        for a in fn.args.args + fn.args.kwonlyargs:
            names = [n.id if isinstance(n, ast.Name) else n.value for n in ast.walk(a.annotation or ast.Pass())
                     if isinstance(n, ast.Name) or isinstance(n, ast.Constant) and isinstance(n.value, str)]
            paths = [p for name in names for p in sections.get(name, [])]   # X | Y: every section of either
            if paths:
                alias[a.arg] = paths
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign):
                t, v = node.targets[0], node.value
                pairs = zip(t.elts, v.elts) if isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple) else [(t, v)]
                for tt, vv in pairs:
                    if isinstance(tt, ast.Name) and value_paths(vv, alias):
                        alias[tt.id] = value_paths(vv, alias)
            elif isinstance(node, ast.Attribute) and _chain(node):
                found.update(resolve(_chain(node), alias))
    return found


def program_reads() -> set[str]:
    sections = _section_paths()
    found: set[str] = set()
    for f in SRC.rglob("*.py"):
        tree = ast.parse(f.read_text())
        if f.parent == SRC / "config":
            tree = ast.Module(body=[n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in CONFIG_HELPERS],
                              type_ignores=[])
        found |= _reads(tree, sections)
    return found


def test_every_config_key_is_read_by_the_program():
    reads = program_reads()
    unread = sorted(k for k in C.all_keys() if k not in reads)
    assert not unread, "config keys nothing reads (wire them, or delete them):\n  " + "\n  ".join(unread)


def test_the_check_sees_a_key_nothing_reads(tmp_path, monkeypatch):
    """The check can fail: a key added to the schema with no reader is reported."""
    @dataclasses.dataclass
    class Extra(C.TrainerConfig):
        nobody_reads_me: int = S._f(0, "test only")

    hints = dict(S._hints(C.PPOConfig), trainer=Extra)
    monkeypatch.setitem(S._HINTS, C.PPOConfig, hints)
    keys = C.all_keys()
    assert "trainer.nobody_reads_me" in keys
    assert "trainer.nobody_reads_me" not in program_reads()


def test_the_step_reads_like_the_algorithm():
    """PPOTrainer.step stays short enough to read as the architecture document's data flow
    (<= 60 lines); the phases live in their own modules."""
    tree = ast.parse((SRC / "trainer" / "ppo.py").read_text())
    step = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "step")
    assert step.end_lineno - step.lineno + 1 <= 60
