"""The README's commands and the configuration reference (docs/configuration.md) stay in step with
the code and CI."""
import re
from pathlib import Path

from megappo.config import config_reference_markdown
from megappo.config.docs import REFERENCE_DOC, reference_in

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")


def command_after(marker: str) -> str:
    m = re.search(rf"<!-- {marker} -->\s*```bash\n(.+?)\n```", README, re.S)
    assert m, f"README has no command block after <!-- {marker} -->"
    return m.group(1).strip()


def test_ci_runs_exactly_the_readme_test_command():
    cmd = command_after("test-command")
    ci = (REPO / ".ci" / "run").read_text()
    lines = [ln.strip() for ln in ci.splitlines()]
    assert cmd in lines, f".ci/run does not run the README's test command {cmd!r}"


def test_main_command_uses_the_setup_script_and_entry_point():
    cmd = command_after("main-command")
    assert cmd.startswith("bash launch/setup_cpu.sh && ")
    script = cmd.split("&&")[1].split()[1]
    assert "-m megappo.train" in (REPO / script).read_text()


def test_config_reference_is_current():
    doc = REPO / "docs" / "configuration.md"
    assert REFERENCE_DOC == doc, "python -m megappo.config would not rewrite docs/configuration.md"
    table = reference_in(doc.read_text(encoding="utf-8"))
    assert table is not None, "docs/configuration.md lacks the config reference markers"
    assert table == config_reference_markdown().strip(), (
        "docs/configuration.md's configuration reference is stale: regenerate it with `python -m megappo.config`")


def test_python_m_megappo_config_rewrites_the_reference(tmp_path):
    import subprocess
    import sys

    doc = tmp_path / "configuration.md"
    doc.write_text("# x\n\n<!-- config-reference:start -->\n| old |\n<!-- config-reference:end -->\n\ntail\n")
    check = [sys.executable, "-m", "megappo.config", "--check", str(doc)]
    assert subprocess.run(check, capture_output=True).returncode == 1
    subprocess.run([sys.executable, "-m", "megappo.config", str(doc)], check=True, capture_output=True)
    assert reference_in(doc.read_text()) == config_reference_markdown().strip()
    assert doc.read_text().startswith("# x\n\n") and doc.read_text().endswith("\n\ntail\n")
    assert subprocess.run(check, capture_output=True).returncode == 0
