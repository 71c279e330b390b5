"""verl's override_config.model_config in a run: the trained actor, vLLM and the checkpoint's
HuggingFace folder all see the merged config.json (verl changes the trained model's only), and
the critic its own entries. The run is also pipelined unevenly (PP2, the first stage one layer of
the four, megatron's num_layers_in_first_pipeline_stage): the weight sync, the checkpoint and its
HF export place the layers as megatron built them."""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

M = "actor_rollout_ref.model.override_config.model_config."
C = "critic.model.override_config.model_config."


def _inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def _one_step(rank, world, setup, run_dir, extra, out):
    from megappo.config import load_config, validate
    from megappo.trainer import PPOTrainer, init_distributed

    cfg = load_config([f"actor_rollout_ref.model.path={setup['model']}", f"data.train_files=[{setup['train']}]",
                       f"data.val_files=[{setup['test']}]", "trainer.logger=[file]", f"trainer.n_gpus_per_node={world}",
                       f"trainer.default_local_dir={run_dir}", "trainer.total_training_steps=1", "trainer.save_freq=1",
                       "trainer.test_freq=-1", "data.max_response_length=6"] + list(extra), ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=world)
    init_distributed(cfg)
    trainer = PPOTrainer(cfg)
    trainer.fit()
    rot = {name: w.chunks[0].rotary_pos_emb.inv_freq.double().tolist()
           for name, w in (("actor", trainer.actor), ("critic", trainer.critic))}
    rot["layers"] = {name: [layer.layer_number - 1 for layer in w.chunks[0].decoder.layers]
                     for name, w in (("actor", trainer.actor), ("critic", trainer.critic))}
    Path(f"{out}.{rank}").write_text(json.dumps(rot))


@pytest.mark.e2e
def test_overridden_entries_reach_the_trained_models_vllm_and_the_checkpoint(tmp_path, monkeypatch):
    from harness import spawn

    monkeypatch.setenv("MEGAPPO_CACHE", str(tmp_path / "cache"))   # the ranks inherit it

    from megappo.data.tiny import make_tiny_setup

    setup = make_tiny_setup(str(tmp_path / "tiny"))
    source = json.loads(Path(setup["model"], "config.json").read_text())
    assert source["rope_parameters"]["rope_theta"] == 10000.0 and source["max_position_embeddings"] == 512
    run, out = tmp_path / "run", tmp_path / "rot.json"
    pp = [f"{role}.megatron.pipeline_model_parallel_size=2" for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref",
                                                                         "critic")]
    spawn(_one_step, 2, setup, str(run), [M + "rope_theta=100.0", M + "max_position_embeddings=1024",
                                          C + "rope_theta=50.0", *pp, "actor_rollout_ref.actor.megatron."
                                          "override_transformer_config.num_layers_in_first_pipeline_stage=1",
                                          "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]"],
          str(out))
    row = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    # vLLM sampled from the model the trainer scores (measured 8e-9; vLLM started on model.path,
    # RoPE base 10,000 against the trainer's 100: 1.5e-3 on this near-uniform random model)
    assert row["training/rollout_probs_diff_max"] < 1e-6, row["training/rollout_probs_diff_max"]
    rot = json.loads(Path(f"{out}.0").read_text())
    # the first stage holds layer 0, the last layers 1-3 (the critic has no split of its own: the actor's)
    assert rot["layers"] == {"actor": [0], "critic": [0]}
    assert json.loads(Path(f"{out}.1").read_text())["layers"] == {"actor": [1, 2, 3], "critic": [1, 2, 3]}
    head_dim = source["head_dim"]
    assert torch.allclose(torch.tensor(rot["actor"], dtype=torch.float64), _inv_freq(100.0, head_dim), rtol=1e-6)
    assert torch.allclose(torch.tensor(rot["critic"], dtype=torch.float64), _inv_freq(50.0, head_dim), rtol=1e-6)
    # the checkpoint's HF folders hold each role's merged config; the weights export loads as it is
    step = run / "global_step_1"
    actor = json.loads((step / "actor" / "huggingface" / "config.json").read_text())
    critic = json.loads((step / "critic" / "huggingface" / "config.json").read_text())
    assert actor["rope_parameters"]["rope_theta"] == 100.0 and actor["max_position_embeddings"] == 1024
    assert critic["rope_parameters"]["rope_theta"] == 50.0 and critic["max_position_embeddings"] == 512
    assert {k: v for k, v in actor.items() if k not in ("rope_parameters", "rope_theta", "max_position_embeddings")} == \
        {k: v for k, v in source.items() if k not in ("rope_parameters", "rope_theta", "max_position_embeddings")}
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(step / "actor" / "huggingface")
    assert model.config.rope_parameters["rope_theta"] == 100.0
    assert math.isclose(float(model.model.rotary_emb.inv_freq[1]), float(_inv_freq(100.0, head_dim)[1]), rel_tol=1e-6)
    # the source folder is untouched; the merged folders are in megappo's cache
    assert json.loads(Path(setup["model"], "config.json").read_text()) == source
    assert len(list((tmp_path / "cache" / "model_overrides").iterdir())) == 2   # the actor's and the critic's
