"""Multi-turn PPO end to end on CPU: vLLM generates conversations with calculator calls, megatron
trains on them. A tiny random model never writes a valid tool call, so every model turn is read
as one and cut at 6 tokens (the loop, the engine, the tools and the trainer are the real ones).
Checks: the megatron actor's log-probs equal the engine's on every model token (1e-4), tool
tokens are exactly the template's tool turns and outside the response mask, and two steps of
PPO with GAE and a critic (token-budget micro-batches, so each is cut to its longest
conversation) log the turn metrics; a run resumed after step 1 repeats step 2 exactly."""
import json
import math
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'


def _scripted_turns():
    """Every model turn reads as a calculator call and ends after 6 tokens."""
    from megappo.rollout import VLLMTurns
    from megappo.trainer import turns

    init, generate = turns.MultiTurnRollout.__init__, VLLMTurns.generate

    def reads_a_call(self, *a, **kw):
        init(self, *a, **kw)
        self.decode = lambda ids: CALL

    turns.MultiTurnRollout.__init__ = reads_a_call
    VLLMTurns.generate = lambda self, prompts, max_tokens, seeds=None: generate(
        self, prompts, [min(m, 6) for m in max_tokens], seeds)


def _run(rank, world, setup, tools_yaml, run_dir, out, extra=()):
    import torch

    from megappo.config import load_config, validate
    from megappo.rollout import SamplingConfig, ToolTurnTokens
    from megappo.trainer import PPOTrainer, init_distributed

    _scripted_turns()
    R = "actor_rollout_ref.rollout.multi_turn."
    cfg = load_config([f"actor_rollout_ref.model.path={setup['model']}", f"data.train_files=[{setup['train']}]",
                       f"data.val_files=[{setup['test']}]", "trainer.logger=[file]", f"trainer.default_local_dir={run_dir}",
                       "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.save_freq=1",
                       "data.max_response_length=48", f"{R}enable=true", f"{R}tool_config_path={tools_yaml}",
                       f"{R}max_assistant_turns=3", "actor_rollout_ref.actor.use_dynamic_bsz=true",
                       "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=160", "critic.ppo_max_token_len_per_gpu=160", *extra],
                      ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=world)
    init_distributed(cfg)
    trainer = PPOTrainer(cfg)
    if trainer.resumed_from:   # resumed: the rest of the run only
        trainer.fit()
        return
    sampling = SamplingConfig.from_config(cfg.actor_rollout_ref.rollout, cfg.data.max_response_length)
    batch, items = trainer.generation.generate(0, sampling, 1)
    lp = trainer.actor.compute_log_prob(batch, **trainer.batching.old_log_prob.kwargs())
    model = batch.response_mask.bool()
    tool = batch.valid_mask.bool() & ~model
    delta = ToolTurnTokens(trainer.tokenizer, trainer.engine.eos_token_ids)(["42"])
    report = {"lp_diff": float((lp - batch.rollout_log_probs)[model].abs().max()),
              "rows": len(batch), "delta": len(delta), "length": int(batch.response_lengths.sum()), "tool_tokens": int(tool.sum()), "model_tokens": int(model.sum()),
              "tool_rows_ok": all(batch.responses[r][tool[r]].tolist() == delta * (int(items[r].extra_info["num_turns"]) // 2 - 1)
                                  for r in range(len(batch))),
              "lp_on_tool_tokens": float(batch.rollout_log_probs[tool].abs().max()),
              "rollout_reward_scores": [it.extra_info["rollout_reward_scores"] for it in items]}
    trainer.generation.pop_metrics()
    history = trainer.fit()
    if rank == 0:
        report["history"] = history
        Path(out).write_text(json.dumps(report))
    torch.distributed.barrier()


@pytest.mark.e2e
def test_multi_turn_ppo_on_cpu(tmp_path):
    from harness import spawn

    from megappo.data.tiny import make_tiny_setup

    setup = make_tiny_setup(str(tmp_path / "tiny"), n_train=32, n_test=4)
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: megappo.tools.Calculator\n    config: {type: native}\n")
    out = tmp_path / "report.json"
    spawn(_run, 2, setup, str(tools), str(tmp_path / "run"), str(out))
    r = json.loads(out.read_text())
    # 8 prompts x n=2; three model turns of at most 6 tokens (fewer where the model wrote its EOS)
    # and two tool turns each
    assert r["rows"] == 16 and 16 * 3 <= r["model_tokens"] <= 16 * 18 and r["tool_rows_ok"]
    assert r["tool_tokens"] == 16 * 2 * r["delta"] and r["lp_on_tool_tokens"] == 0.0
    assert r["length"] == r["model_tokens"] + r["tool_tokens"]
    assert r["lp_diff"] < 1e-4, r["lp_diff"]
    assert r["rollout_reward_scores"] == [{"calculator": 0.0}] * 16
    steps = r["history"]
    assert len(steps) == 2
    for m in steps:
        assert (m["num_turns/min"], m["num_turns/max"], m["num_turns/mean"]) == (6, 6, 6)
        assert m["tools/calls"] == 32 and m["multi_turn/stop/max_assistant_turns"] == 16
        assert 0 < m["multi_turn/tool_token_share"] < 1
        assert m["training/rollout_probs_diff_max"] < 1e-4
        assert math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["critic/vf_loss"])
        # the length counts the tool turns
        assert 2 * r["delta"] < m["response_length/mean"] <= 18 + 2 * r["delta"]
    assert "val-core/synthetic/echo/reward/mean@1" in steps[-1]

    # stopped after step 1 and resumed: step 2 draws and trains exactly as the straight run did
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "run" / "global_step_1", resumed / "global_step_1")
    (resumed / "latest").write_text("1")
    spawn(_run, 2, setup, str(tools), str(resumed), str(out), ["trainer.resume_mode=auto"])
    rows = [json.loads(x) for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    again = next(row for row in rows if row["step"] == 2)
    clock = ("timing_s/", "perf/", "tools/seconds", "tools/max_call_seconds", "agent_loop/tool_calls/")   # wall clock
    stable = {k: v for k, v in steps[1].items() if not k.startswith(clock)}
    assert len(stable) > 50 and "actor/pg_loss" in stable and "num_turns/mean" in stable
    assert {k: again[k] for k in stable} == stable
