"""The documentation holds together: README.md and docs/*.md link only to files (and headings) that
exist, the README stays short and links every doc, and neither carries issue numbers or session
words."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [REPO / "README.md", *DOCS]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file: lower case, punctuation dropped, spaces to
    hyphens, repeated headings numbered."""
    seen: dict[str, int] = {}
    out = set()
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(_prose(path.read_text(encoding="utf-8")))]


def test_anchor_rules():
    p = REPO / "docs" / "architecture.md"
    assert "devices-the-gpu-path-and-the-cpu-device-check" in anchors(p)
    assert "module-map" in anchors(p)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, broken


def test_readme_is_short_and_links_every_doc():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 260
    linked = {t.partition("#")[0] for t in links(REPO / "README.md")}
    assert {f"docs/{d.name}" for d in DOCS} <= linked
    assert DOCS, "docs/ has no pages"
    # the design document is one click from the top of the README
    first = readme.index("docs/architecture.md")
    assert first < readme.index("## The two commands")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_issue_numbers_or_session_words(page):
    text = page.read_text(encoding="utf-8")
    found = re.findall(r"issue \d+/\d+|\(\d/7\)|\bsessions?\b", text, re.I)
    assert not found, found


def test_no_design_file_outside_the_repository():
    for page in PAGES:
        assert "shared/DESIGN.md" not in page.read_text(encoding="utf-8"), page


def test_module_map_markers():
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert "## Module map" in text
    assert text.count("<!-- module-map:start -->") == 1 and text.count("<!-- module-map:end -->") == 1
    assert text.index("<!-- module-map:start -->") < text.index("<!-- module-map:end -->")


def test_module_map_matches_the_tree():
    """docs/architecture.md's module map lists every package and module of src/megappo, and
    nothing else (as the configuration reference is checked against the schema)."""
    import megappo

    src = Path(megappo.__file__).resolve().parent
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- module-map:start -->\n(.*?)<!-- module-map:end -->", text, re.S).group(1)
    listed = re.findall(r"^\| `([^`]+)` \|", block, re.M)
    tree = set()
    for p in src.rglob("*.py"):
        rel = p.relative_to(src).as_posix()
        tree.add(rel if p.name != "__init__.py" or p.parent == src else p.parent.relative_to(src).as_posix() + "/")
    assert len(listed) == len(set(listed)), "a module is listed twice"
    assert not tree - set(listed), f"modules missing from the module map: {sorted(tree - set(listed))}"
    assert not set(listed) - tree, f"the module map lists what the tree lacks: {sorted(set(listed) - tree)}"
