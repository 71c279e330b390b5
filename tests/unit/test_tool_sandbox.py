"""The two shipped tools: the calculator, and the Python sandbox's limits on this machine."""
import ast
import math
import os
import random
import shutil
import tempfile
import textwrap
from pathlib import Path

import pytest

from megappo.tools import Calculator, CalculatorError, PythonSandbox, ToolRunner, ToolCall, calculate, load_tools

# -- calculator ---------------------------------------------------------------------------------


def test_calculator_agrees_with_python_on_random_expressions():
    rng = random.Random(0)

    def expr(depth):
        if depth == 0 or rng.random() < 0.3:
            return str(rng.choice([rng.randint(0, 99), round(rng.uniform(0, 50), 2)]))
        op = rng.choice(["+", "-", "*", "/", "//", "%"])
        return f"({expr(depth - 1)} {op} {expr(depth - 1)})"

    checked = 0
    for _ in range(300):
        e = expr(4)
        try:
            want = eval(compile(ast.parse(e, mode="eval"), "<e>", "eval"), {"__builtins__": {}})
        except ZeroDivisionError:
            with pytest.raises(CalculatorError, match="division by zero"):
                calculate(e)
            continue
        got = calculate(e)
        assert got == want or math.isclose(got, want, rel_tol=1e-12), e
        checked += 1
    assert checked > 200


@pytest.mark.parametrize("expression, answer", [
    ("12 * (3 + 4)", "84"), ("7/2", "3.5"), ("6/3", "2"), ("2^10", "1024"), ("-3 + +2", "-1"),
    ("sqrt(2)", "1.41421356237"), ("max(1, 2, 3) - min(4, 5)", "-1"), ("123456789 * 987654321", "121932631112635269"),
])
def test_calculator_answers(expression, answer):
    assert Calculator().execute("i", {"expression": expression}) == (answer, 0.0, {})


@pytest.mark.parametrize("expression, fragment", [
    ("1/0", "division by zero"), ("9**9**9", "the power is too large"), ("(10**1000)**1000", "the power is too large"),
    ("10.0**500", "too large for a float"), ("1e308*10", "too large for a float"),
    ("__import__('os').system('true')", "Call is not allowed"), ("x + 1", "Name is not allowed"),
    ("'a' * 3", "'a' is not allowed"), ("[1] * 3", "List is not allowed"), ("1 +", "not an arithmetic expression"),
    ("(-8) ** 0.5", "not a real number"), ("sqrt(-1)", "sqrt: math domain error"), ("1" * 3000, "longer than 2000"),
])
def test_calculator_refuses_with_a_reason(expression, fragment):
    with pytest.raises(CalculatorError, match=fragment.replace("(", r"\(").replace("*", r"\*")):
        calculate(expression)
    text, _, metrics = Calculator().execute("i", {"expression": expression})
    assert text.startswith("Error: ") and fragment in text and metrics == {"calculator_error": 1}


def test_shipped_tools_load_from_a_verl_style_config(tmp_path):
    p = tmp_path / "tools.yaml"
    p.write_text("tools:\n  - class_name: megappo.tools.Calculator\n    config: {type: native}\n"
                 "  - class_name: megappo.tools.PythonSandbox\n    config: {type: native, wall_s: 3}\n")
    tools = load_tools(str(p))
    assert set(tools) == {"calculator", "python"} and tools["python"].limits["wall_s"] == 3
    r = ToolRunner(tools, max_parallel_calls=2, timeout_s=10)
    (out,) = r.run_turn(["a"], [[ToolCall("calculator", {"expression": "6*7"}), ToolCall("python", {"code": "print(6*7)"})]])
    assert [o.text for o in out] == ["42", "42\n"]
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['wall'\]"):
        PythonSandbox({"wall": 3})

# -- the sandbox --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sandbox():
    return PythonSandbox({"cpu_s": 1, "wall_s": 4, "memory_mb": 512, "max_processes": 8,
                          "max_output_bytes": 64 << 10, "max_output_chars": 500})


def run(sandbox, code):
    return sandbox.run(textwrap.dedent(code))


def test_output_and_exit_code(sandbox):
    text, info = run(sandbox, "import sys\nprint('hi')\nprint('oops', file=sys.stderr)\nsys.exit(3)")
    assert text == "hi\noops\n[exit code 3]" and info["ending"] == "exit" and info["returncode"] == 3
    text, info = run(sandbox, "print(sum(range(10)))")
    assert text == "45\n" and info["returncode"] == 0


def test_an_infinite_loop_ends_at_the_cpu_limit(sandbox):
    text, info = run(sandbox, "while True:\n    pass")
    assert info["ending"] == "cpu_limit" and text == "[killed: CPU time limit of 1 s]"
    assert 0.9 <= info["seconds"] < 4, info


def test_a_sleeper_ends_at_the_wall_clock_limit(sandbox):
    text, info = run(sandbox, "import time\nprint('start', flush=True)\ntime.sleep(60)")
    assert info["ending"] == "wall_limit" and text == "start\n[killed: wall-clock limit of 4 s]"
    assert 4 <= info["seconds"] < 8, info


def test_a_10_gb_allocation_is_a_memory_error(sandbox):
    text, info = run(sandbox, "x = bytearray(10 * 2**30)")
    assert "MemoryError" in text and info["returncode"] == 1
    text, _ = run(sandbox, "x = bytearray(100 * 2**20)\nprint(len(x))")          # within the limit
    assert text == f"{100 * 2**20}\n"


def test_output_is_capped(sandbox):
    text, info = run(sandbox, "print('y' * 2000)")
    assert text.startswith("y" * 500 + "\n...[") and "more characters]" in text and info["ending"] == "exit"
    text, info = run(sandbox, "import sys\nfor _ in range(100):\n    sys.stdout.write('z' * 4096)")
    assert info["ending"] == "output_limit" and text.endswith("[output stopped at the limit of 65536 bytes]")


def _live_tasks_of(uid):
    """Processes of ``uid`` that still run (a killed one stays a zombie until its new parent reaps it)."""
    n = 0
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                status = dict(line.split(":", 1) for line in (p / "status").read_text().splitlines() if ":" in line)
            except OSError:
                continue
            n += status["Uid"].split()[0] == str(uid) and status["State"].split()[0] not in ("Z", "X")
    return n


def test_a_fork_bomb_is_stopped_and_cleaned_up(sandbox):
    code = """
        import os, time
        n = 0
        try:
            while True:
                if os.fork() == 0:
                    os.setsid()          # leave the process group: the user-id sweep still finds it
                    time.sleep(60)
                    os._exit(0)
                n += 1
        except OSError as e:
            print("forks", n, type(e).__name__)
    """
    text, info = run(sandbox, code)
    if os.geteuid() != 0:
        pytest.skip("not root: RLIMIT_NPROC counts every process of this user; only the process group is killed")
    assert info["isolation/uid"] != 0
    assert text == "forks 7 BlockingIOError\n", text           # max_processes 8, the program included
    assert _live_tasks_of(info["isolation/uid"]) == 0               # no fork outlives the run


def test_what_the_file_system_lets_the_code_do(sandbox):
    """As root the code runs under a fresh user id: what root owns (mode 755 or closer) it cannot
    write. /tmp, /var/tmp and /dev/shm are private tmpfs mounts when a mount namespace could be
    made; otherwise what everyone may write, the code may write too (not isolated)."""
    repo = Path(__file__).resolve().parents[2]
    if any(str(repo).startswith(d) for d in ("/tmp/", "/var/tmp/", "/dev/shm/")):
        pytest.skip("the repository lies where the sandbox mounts its private tmpfs")
    outside = Path(tempfile.mkdtemp(prefix=".sandbox-probe-", dir=repo))      # owned by this user, mode 755
    outside.chmod(0o755)
    try:
        _check_file_system(sandbox, outside)
    finally:
        shutil.rmtree(outside)


def _check_file_system(sandbox, outside):
    text, info = run(sandbox, f"""
        import os
        for p in ["{outside}/x", "/tmp/megappo-sandbox-probe", "here.txt"]:
            try:
                open(p, "w").write("x")
                print(p, "written")
            except OSError as e:
                print(p, type(e).__name__)
        print(sorted(os.listdir(".")))
    """)
    if info["isolation/uid"] == os.getuid():
        pytest.skip("the code ran under this user: nothing outside the temporary directory is protected")
    lines = text.splitlines()
    assert lines[0] == f"{outside}/x PermissionError" and not (outside / "x").exists()
    assert lines[2] == "here.txt written" and lines[3] == "['here.txt', 'main.py']"
    probe = Path("/tmp/megappo-sandbox-probe")
    if info["isolation/private_tmp"]:
        assert lines[1] == f"{probe} written" and not probe.exists()        # written to its own /tmp
    else:
        assert probe.exists()                                                   # not isolated
        probe.unlink()


def test_the_network_namespace_when_the_kernel_allows_it(sandbox):
    text, info = run(sandbox, """
        import os, socket
        print(os.readlink("/proc/self/ns/net"))
        try:
            socket.create_connection(("10.255.255.1", 80), timeout=1)
            print("connected")
        except OSError as e:
            print(type(e).__name__)
    """)
    ns, outcome = text.splitlines()[:2]
    if not info["isolation/netns"]:
        pytest.skip("no network namespace here: the code shares the host's network")
    assert ns != os.readlink("/proc/self/ns/net") and outcome == "OSError"


def test_the_environment_is_minimal_and_the_directory_fresh(sandbox):
    os.environ["MEGAPPO_SECRET_PROBE"] = "s"
    try:
        text, _ = run(sandbox, "import os\nprint(sorted(os.environ))\nprint(os.listdir('.'))")
    finally:
        del os.environ["MEGAPPO_SECRET_PROBE"]
    env, listing = text.splitlines()
    assert "MEGAPPO_SECRET_PROBE" not in env and "PYTHONPATH" in env and listing == "['main.py']"


def test_sandboxes_run_concurrently_through_the_runner():
    """Four programs from four samples at once: each its own user id and directory, in about the
    time of one (they sleep, so two cores suffice)."""
    import time

    r = ToolRunner({"python": PythonSandbox({"wall_s": 5})}, timeout_s=20, max_workers=4)
    code = "import os, time\ntime.sleep(1)\nprint(os.getuid(), os.listdir('.'))"
    t0 = time.perf_counter()
    out = r.run_turn(list(range(4)), [[ToolCall("python", {"code": code})] for _ in range(4)])
    took = time.perf_counter() - t0
    lines = [o[0].text.strip() for o in out]
    assert all(line.endswith("['main.py']") for line in lines), lines
    if os.geteuid() == 0:
        assert len({line.split()[0] for line in lines}) == 4
    assert took < 3.9, took                  # one after another: at least 4 s of sleep
