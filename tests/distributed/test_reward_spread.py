"""Rule and custom rewards spread over the training ranks (gloo, 3 ranks): each sample scored once,
by rank i % 3, and every rank holds every score; a batch reward function is called once, on rank 0,
with every sample; a failure on one rank is raised on all, naming the sample; verl's prime manager
scores each rank's share in worker processes and a hung sample scores 0 on every rank."""
import json
import os

import pytest

from harness import spawn

pytestmark = pytest.mark.distributed

REWARD = '''import os, time

def per_sample(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise ValueError("cannot parse")
    if solution_str == "hang":
        time.sleep(600)
    return {"score": float(solution_str == ground_truth), "rank": int(os.environ["RANK"]), "pid": os.getpid()}

def batched(data_sources, solution_strs, ground_truths, extra_infos):
    return [{"score": float(s == g), "rank": int(os.environ["RANK"]), "seen": len(solution_strs)}
            for s, g in zip(solution_strs, ground_truths)]
'''


def _case(rank, path, name, texts, batched=False, pool=None):
    from megappo.rewards import RewardFunctionError, load_custom_reward, spread_scores

    fn = load_custom_reward(path, name, batched=batched)
    n = len(texts)
    decoded = []

    def decode(i):
        decoded.append(i)
        return texts[i]

    details = []
    try:
        scores, metrics = spread_scores(["src"] * n, decode, ["a"] * n, [None] * n, custom=fn, pool=pool,
                                        details=details)
    except RewardFunctionError as e:
        return {"error": str(e), "decoded": decoded}
    return {"scores": scores, "metrics": metrics, "decoded": decoded,
            "details": [{k: v for k, v in d.items() if k != "pid"} if d else None for d in details],
            "pids": [d["pid"] for d in details if d and "pid" in d]}


def _ranks(rank, world, path, out):
    from megappo.rewards import RewardPool

    texts = ["a", "b", "a", "a", "c", "a", "b"]
    got = {"naive": _case(rank, path, "per_sample", texts),
           "batched": _case(rank, path, "batched", texts, batched=True),
           "error": _case(rank, path, "per_sample", ["a", "a", "a", "a", "raise", "a"])}
    pool = RewardPool(1, timeout_s=1.0, spec=(path, "per_sample", None))
    try:
        got["prime"] = _case(rank, path, "per_sample", ["a", "b", "hang", "a", "raise"], pool=pool)
    finally:
        pool.close()
    got["pid"] = os.getpid()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(got, f)


def test_rewards_are_spread_over_the_ranks(tmp_path):
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    spawn(_ranks, 3, str(reward), str(tmp_path))
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    want = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    for r, g in enumerate(got):
        # every rank: every score, each computed by one rank (i % 3), which decoded only its share
        assert g["naive"]["scores"] == want
        assert [d["rank"] for d in g["naive"]["details"]] == [i % 3 for i in range(7)]
        assert g["naive"]["decoded"] == list(range(r, 7, 3))
        assert set(g["naive"]["pids"]) <= {x["pid"] for x in got}   # (in the ranks themselves)
        # a batch function: one call, on rank 0, with all seven samples
        assert g["batched"]["scores"] == want
        assert all(d["rank"] == 0 and d["seen"] == 7 for d in g["batched"]["details"])
        assert g["batched"]["decoded"] == (list(range(7)) if r == 0 else [])
        # sample 4 fails on rank 1: every rank raises, naming the rank, the function and the sample
        assert g["error"]["error"].startswith("rank 1: "), g["error"]
        assert f"{reward}:per_sample raised on sample 4 (data_source='src'): ValueError: cannot parse" in g["error"]["error"]
        # prime: sample 2 hangs (rank 2's worker), sample 4 raises (rank 1's): 0 each, counted on every rank
        p = g["prime"]
        assert p["scores"] == [1.0, 0.0, 0.0, 1.0, 0.0]
        assert p["metrics"] == {"reward/failed": 2.0, "reward/timed_out": 1.0}
        assert [d.get("rank", d.get("reward_failed")) for d in p["details"]] == [
            0, 1, "sample 2 (data_source='src'): timed out after 1 s", 0,
            f"{reward}:per_sample raised on sample 4 (data_source='src'): ValueError: cannot parse"]
    # the prime calls ran in worker processes, not in the ranks
    ranks = {g["pid"] for g in got}
    assert all(pid not in ranks for g in got for pid in g["prime"]["pids"]) and got[0]["prime"]["pids"]
