"""Rollout correction end to end (algorithm.rollout_correction), with the engine's log-probs
perturbed on purpose (the trainer's rollout is wrapped): truncated importance weights and the
rejection mask are computed from them and logged; bypass mode trains against the engine's
log-probs themselves, with its REINFORCE loss and rejection. The bypass run also has DAPO's
overlong penalty on (reward_model.overlong_buffer)."""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))


def _worker(rank, world, model, train, run_dir, extra):
    import torch

    from megappo.config import load_config, validate
    from megappo.trainer import PPOTrainer, init_distributed
    from megappo.trainer.generation import Generation

    original = Generation.rollout

    def perturbed(self, items, sampling, step, salt=0, offset=0):
        batch, its = original(self, items, sampling, step, salt, offset)
        g = torch.Generator().manual_seed(step)
        noise = 0.5 * torch.randn(batch.rollout_log_probs.shape, generator=g)
        batch.rollout_log_probs = (batch.rollout_log_probs + noise) * batch.response_mask
        return batch, its

    Generation.rollout = perturbed
    cfg = load_config([f"actor_rollout_ref.model.path={model}", f"data.train_files=[{train}]", "data.val_files=[]",
                       "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "data.train_batch_size=8",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.logger=[file]",
                       f"trainer.default_local_dir={run_dir}", "trainer.save_freq=-1", "trainer.test_freq=-1", *extra],
                      ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=world)
    init_distributed(cfg)
    PPOTrainer(cfg).fit(1)


@pytest.mark.e2e
def test_rollout_correction_against_a_perturbed_engine(tmp_path):
    from harness import spawn

    from megappo.data.tiny import make_tiny_setup

    p = make_tiny_setup(str(tmp_path / "tiny"))
    runs = {}
    rc = "algorithm.rollout_correction."
    for name, extra in (("is", [rc + "rollout_is=token", rc + "rollout_is_threshold=1.5",
                                # and rejection sampling of the tokens whose ratio is beyond [0.5, 2]
                                rc + "rollout_rs=token_k1", rc + "rollout_rs_threshold=0.5_2.0"]),
                        ("bypass", [rc + "bypass_mode=true",
                                    # with bypass mode's REINFORCE loss and its own rejection
                                    rc + "loss_type=reinforce", rc + "rollout_is=token", rc + "rollout_rs=token_k3",
                                    rc + "rollout_rs_threshold=0.5",
                                    # and DAPO's overlong penalty over the whole response length
                                    "reward_model.reward_manager=dapo", "reward_model.overlong_buffer.enable=true",
                                    "reward_model.overlong_buffer.len=${data.max_response_length}"])):
        spawn(_worker, 2, p["model"], p["train"], str(tmp_path / name), extra)
        runs[name] = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    first = runs["is"][0]
    # the engine's log-probs differ from the trainer's by the noise (tiny probabilities: small absolute
    # differences): weights far from 1, some truncated
    assert first["training/rollout_probs_diff_max"] > 1e-4        # unperturbed: ~1e-8
    # (truncation pulls their mean back near 1: ~1.02 for this noise, so the spread is what shows)
    assert first["rollout_corr/rollout_is_std"] > 0.2 and first["rollout_corr/rollout_is_eff_sample_size"] < 0.97
    assert 0 < first["rollout_corr/rollout_is_ratio_fraction_low"] < 1
    # some truncated: the max is of the truncated weights (verl's), so the threshold itself
    assert 0 < first["rollout_corr/rollout_is_ratio_fraction_high"] < 1
    assert first["rollout_corr/rollout_is_max"] == pytest.approx(1.5)
    assert first["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-6)   # one mini-batch: starts on-policy
    # rejection sampling dropped some tokens, not all (its metric, verl's name, over both ranks)
    assert 0 < first["rollout_corr/rollout_rs_masked_fraction"] < 1, first
    # bypass: the old log-probs ARE the engine's: no drift metric, and the first update already
    # sees the engine-vs-trainer gap in its ratio
    b = runs["bypass"][0]
    assert b["training/rollout_probs_diff_max"] == 0.0 and "rollout_corr/rollout_is_mean" not in b
    assert abs(b["actor/ppo_kl"]) > 1e-3
    # the overlong penalty reached the scores: every non-empty response pays len / max_len (rule scores >= 0)
    assert b["reward/overlong_fraction"] > 0.5 and b["reward/overlong_penalty_mean"] < 0
    assert b["critic/score/min"] < 0 and "reward/overlong_fraction" not in first
