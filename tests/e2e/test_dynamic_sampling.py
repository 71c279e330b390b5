"""DAPO's dynamic sampling end to end (algorithm.filter_groups): a GRPO step on the tiny echo task,
whose random-init policy scores most groups all 0. With filtering every group the step trains on
has samples that differ in the filter metric, exactly data.train_batch_size prompts after several
generation rounds (counted in train/num_gen_batches); the same step without filtering trains on
uniform groups. A reward that never varies stops the run at max_num_gen_batches, naming the key."""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))

ACC_REWARD = '''
from megappo.rewards import get_reward_fn

def acc_reward(data_source, solution, ground_truth, extra_info=None):
    score = get_reward_fn(data_source)(solution, ground_truth, extra_info)
    return {"score": score, "acc": float(score >= 0.5)}

def constant(data_source, solution, ground_truth, extra_info=None):
    return 1.0
'''


def _worker(rank, world, model, train, run_dir, extra):
    import torch

    from megappo.config import load_config, validate
    from megappo.trainer import PPOTrainer, init_distributed

    original = PPOTrainer.dp_rows

    def recording(self, global_batch):
        """What the step trains on: each group's metric values (every rank holds the global batch)."""
        if self.rank == 0:
            groups = {}
            for g, s in zip(global_batch.prompt_index.tolist(), global_batch.token_level_scores.sum(-1).tolist()):
                groups.setdefault(g, []).append(s)
            Path(run_dir, "trained_groups.json").write_text(json.dumps(groups))
        return original(self, global_batch)

    PPOTrainer.dp_rows = recording
    cfg = load_config([f"actor_rollout_ref.model.path={model}", f"data.train_files=[{train}]", "data.val_files=[]",
                       "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "data.train_batch_size=4",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.logger=[file]",
                       f"trainer.default_local_dir={run_dir}", "trainer.save_freq=-1", "trainer.test_freq=-1", f"trainer.n_gpus_per_node={world}", *extra],
                      ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=world)
    init_distributed(cfg)
    torch.manual_seed(0)
    PPOTrainer(cfg).fit(1)


@pytest.mark.e2e
def test_dynamic_sampling_trains_only_on_informative_groups(tmp_path):
    from harness import spawn

    from megappo.data.tiny import make_tiny_setup

    p = make_tiny_setup(str(tmp_path / "tiny"))
    reward = tmp_path / "acc_reward.py"
    reward.write_text(ACC_REWARD)
    custom = [f"custom_reward_function.path={reward}", "custom_reward_function.name=acc_reward"]
    on = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc", "data.gen_batch_size=8",
          # verl's prime manager: each rank's share scored in a worker process of its own
          "reward_model.reward_manager=prime", "reward_model.prime_workers=1"]
    spawn(_worker, 2, p["model"], p["train"], str(tmp_path / "on"), custom + on)
    spawn(_worker, 1, p["model"], p["train"], str(tmp_path / "off"), custom)

    on_groups = json.loads((tmp_path / "on" / "trained_groups.json").read_text())
    off_groups = json.loads((tmp_path / "off" / "trained_groups.json").read_text())
    row = json.loads((tmp_path / "on" / "metrics.jsonl").read_text().splitlines()[0])
    # exactly train_batch_size prompts of rollout.n samples, renumbered 0..3, none uniform in acc
    assert sorted(map(int, on_groups)) == [0, 1, 2, 3] and all(len(v) == 4 for v in on_groups.values())
    assert all(any(s >= 0.5 for s in v) and any(s < 0.5 for s in v) for v in on_groups.values()), on_groups
    # it took several rounds of 8 prompts (the metric says how many; the kept fraction matches)
    assert row["reward/failed"] == 0 and row["reward/timed_out"] == 0   # (the prime manager scored them)
    rounds = row["train/num_gen_batches"]
    assert rounds >= 2, row
    assert row["train/kept_prompt_fraction"] == pytest.approx(4 / (8 * rounds))
    # the kept groups score higher than everything generated (all-wrong groups were dropped)
    assert row["train/generated_score_mean"] < row["critic/score/mean"]
    # the same first round without filtering: most groups all wrong (zero GRPO advantage)
    assert sum(all(s < 0.5 for s in v) for v in off_groups.values()) >= 2, off_groups
    off_row = json.loads((tmp_path / "off" / "metrics.jsonl").read_text().splitlines()[0])
    assert "train/num_gen_batches" not in off_row


@pytest.mark.e2e
def test_dynamic_sampling_stops_at_max_num_gen_batches(tmp_path):
    from harness import spawn

    from megappo.data.tiny import make_tiny_setup

    p = make_tiny_setup(str(tmp_path / "tiny"))
    reward = tmp_path / "acc_reward.py"
    reward.write_text(ACC_REWARD)
    extra = [f"custom_reward_function.path={reward}", "custom_reward_function.name=constant",
             "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
             "algorithm.filter_groups.max_num_gen_batches=2"]
    with pytest.raises(Exception) as e:
        spawn(_worker, 1, p["model"], p["train"], str(tmp_path / "run"), extra)
    msg = str(e.value)
    assert "2 generation rounds kept 0 of data.train_batch_size=4 prompts" in msg, msg[-2000:]
    assert "algorithm.filter_groups.max_num_gen_batches=2" in msg
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()
