"""Tool turns on the split placement: 2 training ranks and 2 rollout ranks, the rollout ranks
running the turn loop and the tools (the calculator; every model turn read as a call and cut at 6
tokens, as in test_multi_turn_run.py). Synchronous, it trains exactly as the colocated multi-turn
run on 2 ranks (every metric but clocks); one step off, every step after the first trains on
conversations of the weights one update behind, and a run resumed from the step-2 checkpoint
(which stores the conversations in flight) repeats the uninterrupted run's step 3."""
import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))

SPLIT = ["actor_rollout_ref.hybrid_engine=false", "rollout.n_gpus_per_node=2"]
CLOCKS = ("timing_s/", "perf/", "tools/seconds", "tools/max_call_seconds", "agent_loop/tool_calls/")


def _run(rank, world, setup, tools_yaml, run_dir, steps, extra, port=None):
    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    from test_multi_turn_run import _scripted_turns
    from test_split_run import launch

    _scripted_turns()   # in every process: the rollout ranks run the loop
    R = "actor_rollout_ref.rollout.multi_turn."
    launch(world, [f"actor_rollout_ref.model.path={setup['model']}", f"data.train_files=[{setup['train']}]",
                   f"data.val_files=[{setup['test']}]", "trainer.logger=[file]", "trainer.n_gpus_per_node=2",
                   f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={steps}",
                   "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=2",
                   "data.max_response_length=48", f"{R}enable=true", f"{R}tool_config_path={tools_yaml}",
                   f"{R}max_assistant_turns=3", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                   "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=160", "critic.ppo_max_token_len_per_gpu=160",
                   "actor_rollout_ref.actor.optim.lr=1e-3", "critic.model.value_head_init_std=0.5",
                   "actor_rollout_ref.rollout.tensor_model_parallel_size=1"] + list(extra), port)


def _rows(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _stable(row):
    return {k: v for k, v in row.items() if not k.startswith(CLOCKS) and k != "training/weight_version_lag"}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from megappo.data.tiny import make_tiny_setup

    root = tmp_path_factory.mktemp("split_tools")
    tools = root / "tools.yaml"
    tools.write_text("tools:\n  - class_name: megappo.tools.Calculator\n    config: {type: native}\n")
    return root, make_tiny_setup(str(root / "tiny"), n_train=32, n_test=4), str(tools)


@pytest.mark.e2e
def test_split_with_tool_turns_trains_as_colocated(world):
    from harness import free_port, spawn

    root, setup, tools = world
    spawn(_run, 2, setup, tools, str(root / "colocated"), 2, [])
    spawn(_run, 4, setup, tools, str(root / "split"), 2, SPLIT, free_port())
    colocated, split = _rows(root / "colocated"), _rows(root / "split")
    assert [r["step"] for r in split] == [1, 2]
    for a, b in zip(colocated, split):
        assert b["tools/calls"] == 32 and b["num_turns/mean"] == 6   # the rollout ranks ran the tools
        assert b["training/rollout_probs_diff_max"] < 1e-4
        assert _stable(a) == _stable(b), sorted(k for k in _stable(a) if _stable(b).get(k) != _stable(a)[k])


@pytest.mark.e2e
def test_one_step_off_with_tool_turns_resumes_exactly(world):
    from harness import free_port, spawn

    root, setup, tools = world
    extra = SPLIT + ["trainer.async_mode=one_step_off"]
    run = root / "one_step_off"
    spawn(_run, 4, setup, tools, str(run), 3, extra, free_port())
    rows = _rows(run)
    assert [r["training/weight_version_lag"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["tools/calls"] == 32 and r["num_turns/mean"] == 6 for r in rows)
    drift = [r["training/rollout_probs_diff_max"] for r in rows]
    assert drift[0] < 1e-4 and min(drift[1:]) > 1e-3, drift   # one update behind after step 1

    resumed = root / "one_step_off_resumed"
    resumed.mkdir()
    shutil.copytree(run / "global_step_2", resumed / "global_step_2")
    (resumed / "latest").write_text("2")
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    spawn(_run, 4, setup, tools, str(resumed), 3, extra + ["trainer.resume_mode=auto"], free_port())
    again = _rows(resumed)
    assert [r["step"] for r in again] == [1, 2, 3] and again[2]["training/weight_version_lag"] == 1.0
    assert _stable(again[2]) == _stable(rows[2]), sorted(
        k for k in _stable(rows[2]) if _stable(again[2]).get(k) != _stable(rows[2])[k])
