"""Checkpoints inside the training loop: a run stopped after a checkpoint and resumed continues
with the same metrics as the uninterrupted run; a checkpoint resumes under another TP/PP;
``max_*_ckpt_to_keep`` prunes; ``metrics.jsonl`` keeps one line per step across a resume."""
import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))

# Wall-clock figures differ between any two runs; everything else must match.
VOLATILE = ("timing_s/", "perf/")
VAL = "val-core/synthetic/words/reward/mean@1"


def _run(rank, world, setup, run_dir, steps, extra):
    from megappo.config import load_config, validate
    from megappo.trainer import PPOTrainer, init_distributed

    cfg = load_config([f"actor_rollout_ref.model.path={setup['model']}", f"data.train_files=[{setup['train']}]",
                       f"data.val_files=[{setup['test']}]", "trainer.logger=[file]",
                       f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={steps}",
                       "trainer.val_before_train=true", "trainer.test_freq=2",
                       "data.max_response_length=6", "actor_rollout_ref.actor.optim.lr=1e-3"] + list(extra),
                      ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=world)
    init_distributed(cfg)
    PPOTrainer(cfg).fit()


def _rows(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _stable(row):
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE)}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted reference: 4 steps of PPO (GAE, critic), checkpoints at 2 and 4."""
    from harness import spawn

    from megappo.data.tiny import make_tiny_setup

    root = tmp_path_factory.mktemp("resume")
    # words: a random policy scores partly, so prompt groups differ and the default advantage
    # (GRPO's baseline with the critic's correction) moves the actor from the first step; on echo
    # every group of 2 scores 0 and the actor would not move before step 4
    setup = make_tiny_setup(str(root / "tiny"), task="words")
    run = root / "straight"
    spawn(_run, 2, setup, str(run), 4, ["trainer.save_freq=2"])
    return setup, run


@pytest.mark.e2e
def test_resumed_run_continues_with_the_same_metrics(straight, tmp_path):
    from harness import spawn

    setup, run = straight
    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # 0: validation before training
    assert all(VAL in rows[i] for i in (0, 2, 4))
    assert (run / "latest").read_text() == "4"
    state = json.loads((run / "global_step_2" / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["data"]["position"] == 2
    # group_cv's running sums (algo.CvMemory) travel with the checkpoint: sum y^2 > 0 once groups differ
    assert len(state["gae_cv"]["sums"]) == 4 and state["gae_cv"]["sums"][2] > 0, state["gae_cv"]
    assert sorted(os.listdir(run / "global_step_2")) == ["actor", "critic", "manifest.json", "rank_state",
                                                         "trainer_state.json"]
    hf = sorted(os.listdir(run / "global_step_2" / "actor" / "huggingface"))
    assert "config.json" in hf and "tokenizer.json" in hf and not any(f.endswith(".safetensors") for f in hf)

    # The run that died after step 3 (its step-3 line is in metrics.jsonl, its checkpoint is 2).
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    shutil.copytree(run / "global_step_2", crashed / "global_step_2")
    (crashed / "latest").write_text("2")
    (crashed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]) + '{"step": 4, "cut')
    spawn(_run, 2, setup, str(crashed), 4, ["trainer.save_freq=2", "trainer.resume_mode=auto"])
    resumed = _rows(crashed)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]  # the stale step 3 and the torn line are gone
    for want, got in zip(rows[3:], resumed[3:]):
        want, got = _stable(want), _stable(got)
        assert want.keys() == got.keys()
        bad = {k: (want[k], got[k]) for k in want if not math.isclose(want[k], got[k], rel_tol=0, abs_tol=1e-6)}
        assert not bad, f"step {want['step']}: resumed run differs: {bad}"
    # the metrics moved between steps, so equal metrics are not a constant
    assert rows[3]["actor/pg_loss"] != rows[4]["actor/pg_loss"]


@pytest.mark.e2e
def test_resume_under_another_layout_and_pruning(straight, tmp_path):
    """A DP2 checkpoint resumes at TP2 (reshardable load of actor, critic and Adam state); the
    engine gets the loaded weights; only the newest checkpoint is kept."""
    from harness import spawn

    setup, run = straight
    out = tmp_path / "tp2"
    spawn(_run, 2, setup, str(out), 4,
          [f"trainer.resume_mode={run / 'global_step_2'}", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
           "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=1"])
    rows = _rows(out)
    assert [r["step"] for r in rows] == [3, 4]  # no validation before resuming
    assert max(r["training/rollout_probs_diff_max"] for r in rows) < 1e-3  # engine == loaded actor
    ref = _rows(run)[1:]
    # Same weights, same data order and the same per-prompt sampling seeds: the first resumed
    # step sees the same rollouts; only TP's summation order differs.
    assert rows[0]["critic/score/mean"] == ref[2]["critic/score/mean"]
    assert rows[0]["actor/pg_loss"] == pytest.approx(ref[2]["actor/pg_loss"], abs=1e-4)
    assert rows[0]["critic/vf_loss"] == pytest.approx(ref[2]["critic/vf_loss"], abs=1e-4)
    assert sorted(d for d in os.listdir(out) if d.startswith("global_step_")) == ["global_step_4"]
    assert (out / "latest").read_text() == "4"


def _run_with_fault(rank, world, setup, run_dir, steps, extra, fault, at):
    """_run, with a fault injected in this process: "kill" = SIGKILL every rank right after
    step ``at``; "kill_in_save" = SIGKILL while step ``at``'s checkpoint is half written (actor
    saved, critic not); "enospc" = the disk fills up while step ``at``'s checkpoint is written."""
    import errno
    import signal

    from megappo import checkpoint, trainer

    # A rank killed after a checkpoint was written takes its whole process group down with it
    # (something it started kills the group; not identified yet): keep that group away from
    # pytest's, which CI shares.
    os.setpgid(0, 0)

    if fault == "kill":
        original_step = trainer.PPOTrainer.step

        def step(self, log=True):
            out = original_step(self, log)
            if self.step_no == at:
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        trainer.PPOTrainer.step = step
    else:
        original_save = checkpoint.save_worker

        def save_worker(worker, path):
            if f"global_step_{at}" in path and path.endswith("critic"):
                if fault == "kill_in_save":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError(errno.ENOSPC, "No space left on device", path)
            return original_save(worker, path)
        checkpoint.save_worker = save_worker
    _run(rank, world, setup, run_dir, steps, extra)


def _compare(want_rows, got_rows):
    for want, got in zip(want_rows, got_rows):
        want, got = _stable(want), _stable(got)
        assert want.keys() == got.keys()
        bad = {k: (want[k], got[k]) for k in want if not math.isclose(want[k], got[k], rel_tol=0, abs_tol=1e-6)}
        assert not bad, f"step {want['step']}: resumed run differs: {bad}"


@pytest.mark.e2e
def test_killed_at_a_random_step_then_resumed_matches(straight, tmp_path):
    """kill -9 of every rank after a random step (the step's line is logged, its checkpoint maybe
    not), then the same command again (resume_mode=auto): the metrics equal the uninterrupted
    run's from the last checkpoint on."""
    import random

    from harness import spawn

    setup, run = straight
    at = random.choice([1, 3])
    print(f"killing after step {at}")
    crashed = tmp_path / "crashed"
    with pytest.raises(Exception, match="SIGKILL|signal 9|exit code -9"):
        spawn(_run_with_fault, 2, setup, str(crashed), 4, ["trainer.save_freq=2"], "kill", at)
    last = 2 if at == 3 else None
    assert ((crashed / "latest").read_text() if last else None) == (str(last) if last else None)
    spawn(_run, 2, setup, str(crashed), 4, ["trainer.save_freq=2", "trainer.resume_mode=auto"])
    rows, resumed = _rows(run), _rows(crashed)
    assert [r["step"] for r in resumed] == [0, 1, 2, 3, 4]
    _compare(rows[(last or 0) + 1:], resumed[(last or 0) + 1:])


@pytest.mark.e2e
def test_kill_during_checkpoint_write_keeps_the_previous_one(straight, tmp_path):
    from harness import spawn

    from megappo.checkpoint import verify_checkpoint

    setup, run = straight
    crashed = tmp_path / "crashed"
    with pytest.raises(Exception, match="SIGKILL|signal 9|exit code -9"):
        spawn(_run_with_fault, 2, setup, str(crashed), 4, ["trainer.save_freq=2"], "kill_in_save", 4)
    assert (crashed / "latest").read_text() == "2"
    assert (crashed / ".tmp_global_step_4" / "actor").is_dir()          # the half-written save
    assert not (crashed / "global_step_4").exists()
    verify_checkpoint(str(crashed / "global_step_2"))                     # intact, every byte
    spawn(_run, 2, setup, str(crashed), 4, ["trainer.save_freq=2", "trainer.resume_mode=auto"])
    _compare(_rows(run)[3:], _rows(crashed)[3:])
    assert (crashed / "latest").read_text() == "4" and not (crashed / ".tmp_global_step_4").exists()


@pytest.mark.e2e
def test_disk_full_during_save_is_reported_and_the_previous_checkpoint_kept(straight, tmp_path):
    from harness import spawn

    setup, _ = straight
    out = tmp_path / "full"
    with pytest.raises(Exception) as e:
        spawn(_run_with_fault, 2, setup, str(out), 4, ["trainer.save_freq=2"], "enospc", 4)
    msg = str(e.value)
    assert f"CheckpointError: checkpoint {out}/global_step_4 was not saved (the previous checkpoint global_step_2 " \
           "and 'latest' are untouched): rank 0: disk full" in msg, msg[-3000:]
    assert (out / "latest").read_text() == "2" and (out / "global_step_2").is_dir()
    assert not (out / ".tmp_global_step_4").exists() and not (out / "global_step_4").exists()


def test_truncated_or_corrupted_checkpoint_is_named_on_load(straight, tmp_path):
    from megappo.checkpoint import CheckpointError, load_checkpoint

    _, run = straight
    bad = tmp_path / "global_step_2"
    shutil.copytree(run / "global_step_2", bad)
    shard = sorted((bad / "actor").glob("*.distcp"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{shard}: truncated or overwritten: {len(data) // 2} bytes"):
        load_checkpoint(str(bad), {})
    shard.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])  # same size, one byte flipped
    with pytest.raises(CheckpointError, match=f"{shard}: corrupted"):
        load_checkpoint(str(bad), {})
    shard.write_bytes(data)
    (bad / "trainer_state.json").write_text('{"step": 2, "da')
    with pytest.raises(CheckpointError, match="trainer_state.json"):
        load_checkpoint(str(bad), {})


@pytest.mark.e2e
def test_critic_replay_trains_the_critic_only_and_resumes_exactly(straight, tmp_path):
    """critic.replay_batches=2: the critic also trains on the last two batches' rows (the count is
    logged), which changes nothing the actor reads before the critic's second update, and the
    kept rows travel with the checkpoint (each rank's own): a run resumed at step 2 trains its
    critic on the same rows at step 3 as the uninterrupted one."""
    from harness import spawn

    setup, ref = straight
    run = tmp_path / "replay"
    spawn(_run, 2, setup, str(run), 3, ["trainer.save_freq=2", "critic.replay_batches=2"])
    rows, base = _rows(run), _rows(ref)
    per_step = 8 * 2   # tiny_cpu: 8 prompts x 2 samples
    assert [r["critic/replay_samples"] for r in rows[1:]] == [0, per_step, 2 * per_step]
    assert all(r["critic/replay_samples"] == 0 for r in base[1:])
    _compare(base[1:2], rows[1:2])   # step 1: nothing kept yet, the same run
    # step 2: the actor's advantages read the critic after step 1 (the same); the critic's own
    # update sees twice the rows
    assert rows[2]["actor/pg_loss"] == base[2]["actor/pg_loss"]
    assert rows[2]["critic/vf_loss"] != pytest.approx(base[2]["critic/vf_loss"], abs=1e-6)
    assert rows[3]["critic/values/mean"] != pytest.approx(base[3]["critic/values/mean"], abs=1e-6)

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(run / "global_step_2", resumed / "global_step_2")
    (resumed / "latest").write_text("2")
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    spawn(_run, 2, setup, str(resumed), 3, ["trainer.save_freq=2", "trainer.resume_mode=auto",
                                            "critic.replay_batches=2"])
    _compare(rows[3:], _rows(resumed)[3:])
    assert _rows(resumed)[3]["critic/replay_samples"] == 2 * per_step
