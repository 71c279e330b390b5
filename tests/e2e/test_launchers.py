"""Launchers on CPU: the same tiny job through launch/common.sh single-node, as two torchrun
launches (--nnodes 2) on loopback, through launch/slurm.sbatch (with srun/scontrol stand-ins),
and under the Ray launcher on a local cluster of two Ray nodes: all give the same first-step
metrics. Killing one rank makes the job exit non-zero within the distributed timeout, names the
rank, and leaves no process behind (torchrun and Ray)."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VOLATILE = ("timing_s/", "perf/")
TIMEOUT_S = 60  # trainer.dist_timeout_s of these runs

RECIPE = """#!/usr/bin/env bash
: "${{MODEL_PATH:={model}}}" "${{TRAIN_FILES:={train}}}" "${{VAL_FILES:={test}}}" "${{PARALLEL_CONFIG:=tiny_cpu}}"
: "${{TRAIN_BATCH_SIZE:=8}}" "${{PPO_MINI_BATCH_SIZE:=4}}" "${{MAX_PROMPT_LENGTH:=16}}" "${{MAX_RESPONSE_LENGTH:=4}}"
: "${{PPO_MAX_TOKEN_LEN_PER_GPU:=1024}}" "${{ACTOR_LR:=1e-3}}" "${{CRITIC_LR:=1e-3}}" "${{ROLLOUT_TP:=1}}" "${{ROLLOUT_N:=2}}"
: "${{TOTAL_EPOCHS:=1}}" "${{SAVE_FREQ:=-1}}" "${{TEST_FREQ:=-1}}" "${{ACTOR_TP:=1}}" "${{ACTOR_PP:=1}}"
source {repo}/launch/common.sh
megappo_launch trainer.val_before_train=false trainer.resume_mode=disable trainer.logger=[file] \\
  trainer.dist_timeout_s={timeout} "$@"
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    from megappo.data.tiny import make_tiny_setup

    root = tmp_path_factory.mktemp("launch")
    p = make_tiny_setup(str(root / "tiny"))
    path = root / "tiny_recipe.sh"
    path.write_text(RECIPE.format(model=p["model"], train=p["train"], test=p["test"], repo=REPO, timeout=TIMEOUT_S))
    return path


def _env(**kw):
    return dict(os.environ, PYTHON=sys.executable, MASTER_ADDR="127.0.0.1", **{k: str(v) for k, v in kw.items()})


def _launch(recipe, run_dir, steps=2, **env):
    return subprocess.Popen(["bash", str(recipe), f"trainer.default_local_dir={run_dir}",
                             f"trainer.total_training_steps={steps}"], env=_env(**env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p, timeout=600):
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-4000:]
    return out, err


def _first_step(run_dir):
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {k: v for k, v in rows[0].items() if not k.startswith(VOLATILE)}


def _same(a, b):
    assert a.keys() == b.keys()
    bad = {k: (a[k], b[k]) for k in a if abs(a[k] - b[k]) > 1e-6}
    assert not bad, bad


@pytest.fixture(scope="module")
def single(recipe, tmp_path_factory):
    run = tmp_path_factory.mktemp("single") / "run"
    out, _ = _finish(_launch(recipe, run, NNODES=1, NGPUS_PER_NODE=2, MASTER_PORT=_port()))
    assert "train: TP=1 PP=1 DP=2" in out
    return _first_step(run)


@pytest.mark.e2e
def test_torchrun_two_nodes_on_loopback(recipe, single, tmp_path):
    port = _port()
    nodes = [_launch(recipe, tmp_path / "run", NNODES=2, NGPUS_PER_NODE=1, NODE_RANK=r, MASTER_PORT=port)
             for r in (0, 1)]
    outs = [_finish(p) for p in nodes]
    assert "world=2 (2 node(s) x 1)" in outs[0][0]
    _same(single, _first_step(tmp_path / "run"))


@pytest.mark.e2e
def test_slurm_sbatch_runs_one_torchrun_per_node(recipe, single, tmp_path):
    """launch/slurm.sbatch with stand-ins for srun (runs its command once per node here, with
    SLURM_NODEID set) and scontrol (the allocation's first host is this machine)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\necho 127.0.0.2\n")
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        "n=1; while [[ $1 == --* ]]; do\n"
        "  case $1 in --nodes) n=$2; shift 2 ;; --ntasks-per-node) shift 2 ;; *) shift ;; esac\n"
        "done\n"
        "echo \"srun: $n tasks: $*\" > \"$SRUN_LOG\"\n"
        "pids=(); for ((i=0; i<n; i++)); do SLURM_NODEID=$i \"$@\" & pids+=($!); done\n"
        "rc=0; for p in \"${pids[@]}\"; do wait $p || rc=$?; done; exit $rc\n")
    for f in ("scontrol", "srun"):
        (bin_dir / f).chmod(0o755)
    env = _env(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID=4242, SLURM_JOB_NUM_NODES=2,
               SLURM_JOB_NODELIST="node[1-2]", NGPUS_PER_NODE=1, SRUN_LOG=tmp_path / "srun.log",
               MASTER_PORT=_port())
    env.pop("MASTER_ADDR")
    p = subprocess.run(["bash", str(REPO / "launch" / "slurm.sbatch"), str(recipe),
                        f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.total_training_steps=2"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    log = (tmp_path / "srun.log").read_text()
    assert "srun: 2 tasks: bash -c" in log and "--node_rank \"$SLURM_NODEID\"" in log and "127.0.0.1" in log
    _same(single, _first_step(tmp_path / "run"))


@pytest.fixture(scope="module")
def ray_cluster():
    """A head and a second Ray node on this machine, one CPU each."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


@pytest.mark.e2e
def test_ray_launcher_on_two_ray_nodes(recipe, single, ray_cluster, tmp_path):
    p = _launch(recipe, tmp_path / "run", LAUNCHER="ray", RAY_ADDRESS=ray_cluster.address, NNODES=2,
                NGPUS_PER_NODE=1)
    out, err = _finish(p)
    assert "megappo ray: 2 ranks on 2 node(s)" in out + err
    _same(single, _first_step(tmp_path / "run"))


def _rank_pids(run_dir, rank):
    import psutil

    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(str(run_dir) in a for a in proc.info["cmdline"] or []) and "megappo.train" in " ".join(
                    proc.info["cmdline"]) and proc.environ().get("RANK") == str(rank):
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def _kill_rank_after_first_step(p, run_dir, rank=1):
    metrics = Path(run_dir) / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.exists() and metrics.read_text().strip()):
        assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.time() < deadline, "the job never finished a step"
        time.sleep(0.5)
    pids = _rank_pids(run_dir, rank)
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    t0 = time.time()
    out, err = p.communicate(timeout=TIMEOUT_S + 60)
    return time.time() - t0, out, err


def _no_leftovers(run_dir):
    import psutil

    time.sleep(2)
    left = [q.pid for q in psutil.process_iter(["cmdline"]) if any(str(run_dir) in a for a in q.info["cmdline"] or [])]
    assert not left, f"processes left behind: {left}"


@pytest.mark.e2e
def test_killing_a_rank_stops_torchrun_job(recipe, tmp_path):
    run = tmp_path / "run"
    p = _launch(recipe, run, steps=50, NNODES=1, NGPUS_PER_NODE=2, MASTER_PORT=_port())
    took, out, err = _kill_rank_after_first_step(p, run)
    assert p.returncode != 0
    assert took < TIMEOUT_S, f"the job took {took:.0f} s to stop"
    assert "rank      : 1" in err or "rank: 1" in err, err[-3000:]  # torchrun's failure summary
    _no_leftovers(run)


@pytest.mark.e2e
def test_killing_a_rank_stops_ray_job(recipe, ray_cluster, tmp_path):
    run = tmp_path / "run"
    p = _launch(recipe, run, steps=50, LAUNCHER="ray", RAY_ADDRESS=ray_cluster.address, NNODES=2, NGPUS_PER_NODE=1)
    took, out, err = _kill_rank_after_first_step(p, run)
    assert p.returncode != 0
    assert took < TIMEOUT_S, f"the job took {took:.0f} s to stop"
    assert "megappo ray: rank 1 was killed by SIGKILL" in err, err[-3000:]
    _no_leftovers(run)


@pytest.mark.e2e
@pytest.mark.parametrize("launcher", ["torchrun", "ray"])
def test_a_rank_that_raises_stops_the_job_and_is_named(recipe, launcher, request, tmp_path):
    """Rank 1's reward function raises at step 1: the job exits non-zero well within the
    timeout, every rank raises the error (the rewards are spread over the ranks and a failure on
    one is agreed by all), which names rank 1 and what failed, the launcher names a failed rank
    with it, nothing is left."""
    reward = tmp_path / "reward.py"
    reward.write_text("import os\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    if os.environ.get('RANK') == '1':\n        raise RuntimeError('boom on rank 1')\n"
                      "    return 0.0\n")
    run = tmp_path / "run"
    env = dict(NNODES=1, NGPUS_PER_NODE=2, MASTER_PORT=_port())
    if launcher == "ray":
        env.update(LAUNCHER="ray", RAY_ADDRESS=request.getfixturevalue("ray_cluster").address, NNODES=2,
                   NGPUS_PER_NODE=1)
    t0 = time.time()
    p = subprocess.Popen(["bash", str(recipe), f"trainer.default_local_dir={run}", "trainer.total_training_steps=5",
                          f"custom_reward_function.path={reward}"], env=_env(**env),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=600)
    assert p.returncode != 0
    said = r"RewardFunctionError: rank 1: \S+ raised on sample \d+ \(data_source=[^)]*\): RuntimeError: boom on rank 1"
    assert re.search(r"megappo: rank [01] failed: " + said, err), err[-3000:]
    if launcher == "ray":
        # the first rank to fail, with its error (both raise the same one)
        assert re.search(r"megappo ray: rank [01] exited with status 1: " + said, err), err[-3000:]
    else:
        assert re.search(r"rank\s*: [01]", err), err[-3000:]
    print(f"{launcher}: failed job ended after {time.time() - t0:.0f} s")
    _no_leftovers(run)
