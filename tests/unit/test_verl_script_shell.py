"""--verl-compat reads a verl launch script as the shell would run it: its variables, defaults and
arithmetic expanded (bash computes the same words: checked against bash itself where it is here)."""
import re
import shutil
import subprocess
import sys

import pytest

SCRIPT = r"""#!/usr/bin/env bash
set -x
# a comment with key.x=1
export VLLM_USE_V1=1
NNODES=${NNODES:-2}
RAY_DATA_HOME=${RAY_DATA_HOME:-"${HOME}/verl"}
max_prompt_length=$((1024 * 2))
max_response_length=$((1024 * 8))
actor_ppo_max_token_len=$(((max_prompt_length + max_response_length) * 3 / 2))
train_files="['$RAY_DATA_HOME/a.parquet', '$RAY_DATA_HOME/b.parquet']"
offload=True
ROLLOUT_CONFIG="
    actor_rollout_ref.rollout.n=${n_resp:-16} \
    actor_rollout_ref.rollout.name=${1:-vllm}"
CKPT=$(pwd)/ckpt   # command substitution: only running the script knows
python3 -c "import ray; ray.init(address=None)"
HYDRA_FULL_ERROR=1 python3 -m verl.trainer.main_ppo --config-path=config \
    --config-name='ppo_megatron_trainer.yaml' \
    data.train_files="$train_files" \
    data.max_prompt_length=${max_prompt_length} \
    data.max_response_length=$max_response_length \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=$actor_ppo_max_token_len \
    actor_rollout_ref.actor.megatron.param_offload=${offload} \
    trainer.nnodes=$NNODES \
    trainer.default_local_dir=$CKPT \
    $ROLLOUT_CONFIG \
    trainer.total_epochs=15 $@
"""

WANT = ["data.train_files=['/home/u/verl/a.parquet', '/home/u/verl/b.parquet']",
        "data.max_prompt_length=2048", "data.max_response_length=8192",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=15360",
        "actor_rollout_ref.actor.megatron.param_offload=True", "trainer.nnodes=2",
        "trainer.default_local_dir=$(pwd)/ckpt",
        "actor_rollout_ref.rollout.n=16", "actor_rollout_ref.rollout.name=vllm", "trainer.total_epochs=15"]


def test_a_scripts_overrides_are_the_words_the_shell_passes():
    from megappo.config.shell import script_overrides

    assert script_overrides(SCRIPT, {"HOME": "/home/u"}) == WANT
    # the environment fills what the script leaves unset, and ${name:-default} prefers it
    got = script_overrides(SCRIPT, {"HOME": "/home/u", "NNODES": "4", "n_resp": "8"})
    assert "trainer.nnodes=4" in got and "actor_rollout_ref.rollout.n=8" in got


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_words_equal_what_bash_passes(tmp_path):
    """The script run by bash with python3 replaced by a printer of its arguments."""
    from megappo.config.shell import script_overrides

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text("#!/bin/sh\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done\n")
    (bin_dir / "python3").chmod(0o755)
    (bin_dir / "pwd").write_text("#!/bin/sh\necho /run/here\n")
    (bin_dir / "pwd").chmod(0o755)
    script = tmp_path / "run.sh"
    script.write_text(SCRIPT.replace("$(pwd)", "$(" + str(bin_dir / "pwd") + ")"))
    env = {"HOME": "/home/u", "PATH": f"{bin_dir}:/usr/bin:/bin"}
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, check=True).stdout
    words = [w for w in out.splitlines() if re.fullmatch(r"[a-z_]+\.[\w.]+=.*", w)]
    ours = script_overrides(SCRIPT, env)
    assert [w for w in ours if "$" not in w] == [w for w in words if "default_local_dir" not in w]
    assert "trainer.default_local_dir=/run/here/ckpt" in words


@pytest.mark.parametrize("text, env, want", [
    ("$((7 / 2))", {}, "3"), ("$(( (a + b) * c ))", {"a": "1", "b": "2", "c": "4"}, "12"),
    ("$(((x)))", {"x": "5"}, "5"), ("$((unset + 1))", {}, "1"), ("$((a / 0))", {"a": "1"}, "$((a / 0))"),
    ("$((a + 1))", {"a": "abc"}, "$((a + 1))"), ("${a:-x}-${b:=y}-${c}", {"a": ""}, "x-y-${c}"),
    ("$a.$b", {"a": "1", "b": "2"}, "1.2"), ("$HOME_X", {"HOME": "/h"}, "$HOME_X"),
    ("$(( ${A:-2} * 4 ))", {}, "8"), ("$((a / 2)) $((a % 2))", {"a": "-7"}, "-3 -1"),   # bash truncates
    ("${x-d}|${x:-d}|${y-d}", {"x": ""}, "|d|d"), ("'$a' \"$a\" \\$a", {"a": "1"}, "'$a' \"1\" $a"),
    ("$((2 ** 3))", {}, "$((2 ** 3))"),
])
def test_expansions(text, env, want):
    from megappo.config.shell import expand

    assert expand(text, env) == want


def test_the_cli_says_what_it_could_not_check(tmp_path):
    cmd = tmp_path / "run_verl.sh"
    cmd.write_text(SCRIPT)
    p = subprocess.run([sys.executable, "-m", "megappo.config", "--verl-compat", str(cmd)], capture_output=True,
                       text=True, env={"HOME": "/home/u", "PATH": "/usr/bin:/bin"})
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    assert "unchecked trainer.default_local_dir: its value comes from the shell at run time ($(pwd)/ckpt)" in lines
    assert lines[-1] == "10 overrides: 0 refused or unknown, 1 unchecked"
    assert "set       actor_rollout_ref.actor.ppo_max_token_len_per_gpu: a megappo key" in lines


def test_what_bash_does_with_comments_several_assignments_and_exports():
    from megappo.config.shell import script_overrides

    script = ("# a.comment=1 \\\npython3 -m verl a.b=1 name.x=qwen#1 # c.d=2\n"
              "export A=3 B=4; c=5 && python3 x e.f=$A.$B.$c\n")
    assert script_overrides(script, {}) == ["a.b=1", "name.x=qwen#1", "e.f=3.4.5"]
