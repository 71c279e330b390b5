"""The README's commands and reference table stay in step with the code and CI."""
import re
from pathlib import Path

from megappo.config import config_reference_markdown

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
    m = re.search(r"<!-- config-reference:start -->\n(.*?)\n<!-- config-reference:end -->", README, re.S)
    assert m, "README lacks the config reference markers"
    assert m.group(1).strip() == config_reference_markdown().strip(), (
        "README's configuration reference is stale: regenerate it with `python -m megappo.config`")
