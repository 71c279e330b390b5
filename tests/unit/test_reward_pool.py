"""verl's prime reward manager: reward calls in worker processes, each sample with a time limit;
a sample that hangs, raises or kills its worker scores 0 and the pool goes on."""
import os
import time

import pytest

from megappo.rewards import RewardPool

REWARD = '''import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    if solution_str == "hang":
        time.sleep(600)
    if solution_str == "raise":
        raise ValueError("bad answer")
    if solution_str == "crash":
        os._exit(3)
    return {"score": float(solution_str == ground_truth) + bonus, "pid": os.getpid()}
'''


@pytest.fixture
def reward_file(tmp_path):
    p = tmp_path / "reward.py"
    p.write_text(REWARD)
    return str(p)


def _task(i, sol, gt="a"):
    return (i, ("src", sol, gt, None))


def test_pool_scores_and_survives_hangs_errors_and_crashes(reward_file):
    pool = RewardPool(2, timeout_s=2.0, spec=(reward_file, "compute_score", {"bonus": 0.5}))
    try:
        t0 = time.monotonic()
        out = pool.score([_task(10, "a"), _task(11, "hang"), _task(12, "b"), _task(13, "raise"), _task(14, "crash"),
                          _task(15, "a")])
        took = time.monotonic() - t0
        assert [r[1]["score"] if r else None for r in out.results] == [1.5, None, 0.5, None, None, 1.5]
        assert {r[0] for r in out.results if r} == {f"{reward_file}:compute_score"}   # where, for messages
        assert sorted(out.failed) == [1, 3, 4] and out.timed_out == 1
        assert out.failed[1] == "sample 11 (data_source='src'): timed out after 2 s"
        assert out.failed[3].startswith(f"{reward_file}:compute_score raised on sample 13 (data_source='src'): "
                                        "ValueError: bad answer")
        assert out.failed[4] == "sample 14 (data_source='src'): its worker died (exit code 3)"
        pids = {r[1]["pid"] for r in out.results if r}
        assert os.getpid() not in pids
        assert took < 30, took   # the hang cost its limit, not 600 s
        # the replaced workers score the next batch; nothing is left of the old ones
        again = pool.score([_task(0, "a"), _task(1, "x")])
        assert [r[1]["score"] for r in again.results] == [1.5, 0.5] and not again.failed
        procs = list(pool.procs)
        assert all(p.is_alive() for p in procs)
    finally:
        pool.close()
    assert not any(p.is_alive() for p in procs)


def test_pool_runs_the_built_in_rules():
    from megappo.rewards import synthetic

    pool = RewardPool(1, timeout_s=30.0)
    try:
        out = pool.score([(0, (synthetic.ECHO_SOURCE, "t10 t11", "t10 t11", None)),
                          (1, ("nobody/knows", "x", "y", None))])
        assert out.results[0] == (f"built-in reward for {synthetic.ECHO_SOURCE!r}", synthetic.echo_score("t10 t11", "t10 t11"))
        assert out.results[1] is None
        assert "no reward function for data_source 'nobody/knows'" in out.failed[1]
    finally:
        pool.close()


def test_a_worker_that_cannot_load_the_function_is_named(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nif os.getpid() != int(os.environ['PARENT']):\n    raise ImportError('no such lib')\n"
                   "def compute_score(a, b, c, d):\n    return 1.0\n")
    os.environ["PARENT"] = str(os.getpid())
    try:
        pool = RewardPool(1, timeout_s=5.0, spec=(str(bad), "compute_score", None))
        with pytest.raises(RuntimeError, match=rf"reward worker 0 did not start: it loads {bad} in a new process: "
                                               r"RewardFunctionError: .*ImportError: no such lib"):
            pool.score([_task(0, "a")])
        assert all(p is None for p in pool.procs)
    finally:
        del os.environ["PARENT"]


def test_a_trainer_that_dies_takes_a_busy_worker_along(tmp_path, reward_file):
    """A worker inside a hung call never reads the end of its pipe: the kernel ends it with the
    process that started it (PR_SET_PDEATHSIG), so a killed trainer leaves no verifier running."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "trainer.py"
    script.write_text(f"""
import sys, time
from megappo.rewards import RewardPool
if __name__ == "__main__":
    pool = RewardPool(1, timeout_s=600.0, spec=({reward_file!r}, "compute_score", None))
    pool._ensure()
    print(pool.procs[0].pid, flush=True)
    pool.conns[0].send((0, 0, ("src", "hang", "a", None)))
    time.sleep(600)
""")
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    worker = int(p.stdout.readline())
    time.sleep(0.5)   # the worker is in its hung call
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    for _ in range(50):
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{worker}/stat") as f:
            if f.read().split(")")[-1].split()[0] == "Z":   # ended, not yet reaped
                break
        time.sleep(0.1)
    else:
        os.kill(worker, signal.SIGKILL)
        raise AssertionError("the busy reward worker outlived its trainer")


def test_a_failed_sample_reads_0_for_dapos_acc_and_gdpos_components():
    """Under prime a failed sample scores 0 and its details say why; DAPO's acc filter and
    gdpo's components read 0 there instead of stopping the run."""
    from megappo.trainer.scoring import _acc, _reward_components

    details = [{"score": 1.0, "acc": 1.0, "fmt": 0.5}, {"score": 0.0, "reward_failed": "timed out"}]
    assert _acc(details, False).tolist() == [1.0, 0.0]
    assert {k: v.tolist() for k, v in _reward_components(details, ["acc", "fmt"]).items()} == {
        "acc": [1.0, 0.0], "fmt": [0.5, 0.0]}
    with pytest.raises(Exception, match="sample 1 returned None"):   # a sample that did not fail must say acc
        _acc([details[0], None], False)
