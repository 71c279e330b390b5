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
        assert [r["score"] if r else None for r in out.results] == [1.5, None, 0.5, None, None, 1.5]
        assert sorted(out.failed) == [1, 3, 4] and out.timed_out == 1
        assert out.failed[1] == "sample 11 (data_source='src'): timed out after 2 s"
        assert out.failed[3].startswith(f"{reward_file}:compute_score raised on sample 13 (data_source='src'): "
                                        "ValueError: bad answer")
        assert out.failed[4] == "sample 14 (data_source='src'): its worker died (exit code 3)"
        pids = {r["pid"] for r in out.results if r}
        assert os.getpid() not in pids
        assert took < 30, took   # the hang cost its limit, not 600 s
        # the replaced workers score the next batch; nothing is left of the old ones
        again = pool.score([_task(0, "a"), _task(1, "x")])
        assert [r["score"] for r in again.results] == [1.5, 0.5] and not again.failed
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
        assert out.results[0] == synthetic.echo_score("t10 t11", "t10 t11") and out.results[1] is None
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
