"""LoRA in the training loop (TP2 x PP2, gloo, vLLM on every rank): the engine serves the adapters
synced in memory and its log-probs equal the trainer's after every sync; the reference is the base
(adapters off: a KL once the adapters moved); a sync moves the adapters only; checkpoints hold only what
trains and a resumed run continues with the same metrics; where the engine cannot serve adapters
the merged weights go instead, with the same equality."""
import json
import math
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))

VOLATILE = ("timing_s/", "perf/")
RANK, ALPHA = 8, 16


def _run(rank, world, setup, run_dir, steps, extra, merged=False):
    from megappo.config import load_config, validate
    from megappo.trainer import PPOTrainer, init_distributed

    if merged:   # an engine that cannot serve adapters (vLLM's ranks stop at 512): merged weights
        from megappo import builders

        builders.engine_lora_rank = lambda cfg: 0
    tp_pp = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
             "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"] if world == 4 else []
    cfg = load_config([f"actor_rollout_ref.model.path={setup['model']}", f"data.train_files=[{setup['train']}]",
                       f"data.val_files=[{setup['test']}]", "trainer.logger=[file]",
                       f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={steps}",
                       "trainer.test_freq=-1", "trainer.val_before_train=false", "data.max_response_length=6",
                       "actor_rollout_ref.actor.optim.lr=1e-2", "critic.optim.lr=1e-2",
                       f"actor_rollout_ref.model.lora_rank={RANK}", f"actor_rollout_ref.model.lora_alpha={ALPHA}",
                       f"critic.model.lora_rank={RANK}", "actor_rollout_ref.actor.use_kl_loss=true",
                       # values start non-zero: advantages (and updates) from the first step, rewards or not
                       "critic.model.value_head_init_std=0.5",
                       # one mini-batch per step: the actor's first update of a step starts from the
                       # weights that made the batch, so its KL is to the reference alone
                       "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                       f"trainer.n_gpus_per_node={world}"] + tp_pp + list(extra), ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=world)
    init_distributed(cfg)
    PPOTrainer(cfg).fit()


def _rows(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _sizes(model_dir):
    """(bytes of every weight of the HF model, bytes of its rank-RANK all-linear adapters), fp32."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    h, f, L = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    q, kv = c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"]
    shapes = [(q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f)]   # q k v o gate up down: (out, in)
    layer = sum(o * i for o, i in shapes) + 2 * h + 2 * c["head_dim"]      # + two norms, q/k norms
    full = L * layer + c["vocab_size"] * h * (1 if c["tie_word_embeddings"] else 2) + h
    adapters = L * sum(RANK * (o + i) for o, i in shapes)
    return 4 * full, 4 * adapters


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """4 steps of PPO (GAE, a LoRA critic, KL loss against the base), checkpoints at 2 and 4."""
    from harness import spawn

    from megappo.data.tiny import make_tiny_setup

    root = tmp_path_factory.mktemp("lora")
    # words: a random policy scores partly, so the default advantage (GRPO's group baseline with
    # the critic's correction) moves the adapters from the first step (echo's groups all score 0)
    setup = make_tiny_setup(str(root / "tiny"), task="words")
    run = root / "straight"
    spawn(_run, 4, setup, str(run), 4, ["trainer.save_freq=2"] + HF_MODEL)
    return setup, run


# every save also writes both roles as HuggingFace folders (verl's hf_model), merged
HF_MODEL = [f"{role}.checkpoint.save_contents=[model,optimizer,extra,hf_model]"
            for role in ("actor_rollout_ref.actor", "critic")]


@pytest.mark.e2e
def test_lora_run_engine_equals_trainer_and_syncs_adapters_only(straight):
    setup, run = straight
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    full, adapters = _sizes(setup["model"])
    for r in rows:
        # vLLM's LoRA kernels over the synced adapters vs megatron's adapted layers, every step
        assert r["training/rollout_probs_diff_max"] < 1e-4, r
        # steps after the first send the adapters only (the base went once, before step 1)
        assert r["rollout/sync_bytes"] == adapters, (r["rollout/sync_bytes"], adapters, full)
    assert adapters < 0.15 * full
    # the reference is the base (adapters off): 0 while B is 0 (step 1), positive once the
    # adapters moved (a reference that kept them on would give 0 on every step)
    assert rows[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-9)
    assert all(r["actor/kl_loss"] > 1e-6 for r in rows[1:]) and all(r["actor/grad_norm"] > 0 for r in rows), rows
    assert all(r["critic/grad_norm"] > 0 for r in rows)   # the LoRA critic (adapters, value head) trains


@pytest.mark.e2e
def test_lora_checkpoint_holds_only_what_trains_and_resumes_exactly(straight, tmp_path):
    import shutil

    from harness import spawn
    from megatron.core import dist_checkpointing

    from megappo.checkpoint import read_lora_file

    setup, run = straight
    step2 = run / "global_step_2"
    lora = read_lora_file(str(step2 / "actor"))
    assert lora["r"] == RANK and lora["lora_alpha"] == ALPHA and len(lora["target_modules"]) == 7
    assert lora["base_model_name_or_path"] == setup["model"]
    assert read_lora_file(str(step2 / "critic"))["r"] == RANK
    for role, trained in (("actor", ("lora_",)), ("critic", ("lora_", "output_layer"))):
        keys = [k for k in dist_checkpointing.load_tensors_metadata(str(step2 / role)) if not k.startswith("optimizer")]
        assert keys and all(any(t in k for t in trained) for k in keys), (role, keys[:8])
        assert any("linear_qkv.lora.lora_B.q_proj" in k for k in keys)

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(step2, resumed / "global_step_2")
    (resumed / "latest").write_text("2")
    spawn(_run, 4, setup, str(resumed), 4, ["trainer.save_freq=2", "trainer.resume_mode=auto"])
    want, got = _rows(run)[2:], _rows(resumed)
    assert [r["step"] for r in got] == [3, 4]
    for w, g in zip(want, got):
        w = {k: v for k, v in w.items() if not k.startswith(VOLATILE)}
        g = {k: v for k, v in g.items() if not k.startswith(VOLATILE)}
        assert w.keys() == g.keys()
        bad = {k: (w[k], g[k]) for k in w if not math.isclose(w[k], g[k], rel_tol=0, abs_tol=1e-6)}
        assert not bad, f"step {w['step']}: the resumed LoRA run differs: {bad}"


def _converted(run, out, *extra):
    from megappo.convert.cli import convert_to_hf_main

    assert convert_to_hf_main(["--ckpt", str(run), "--out", str(out), "--quiet", *extra]) == 0
    return out


@pytest.mark.e2e
def test_lora_checkpoint_converts_to_a_peft_adapter_and_merged_weights(straight, tmp_path):
    """The converter's PEFT folder loads in PEFT; its merged HF folder computes what PEFT's LoRA
    model computes (two independent paths: megappo's merge vs PEFT's forward)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from megappo.convert.cli import convert_to_hf_main

    setup, run = straight
    peft_dir = _converted(run, tmp_path / "adapter")
    merged_dir = _converted(run, tmp_path / "merged", "--merge")
    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    assert cfg["r"] == RANK and cfg["lora_alpha"] == ALPHA and cfg["base_model_name_or_path"] == setup["model"]
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(setup["model"], dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, str(peft_dir)).eval()(ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32)(ids).logits
    assert (peft_logits - merged_logits).abs().max() < 1e-5
    assert (peft_logits - base_logits).abs().max() > 1e-3      # the trained adapters are in both
    # a full-weight checkpoint has no adapters to merge: named, exit code 2
    assert convert_to_hf_main(["--ckpt", str(run), "--critic", "--out", str(tmp_path / "x"), "--merge"]) == 2


@pytest.mark.e2e
def test_lora_checkpoint_hf_model_is_the_merged_export(straight, tmp_path):
    """save_contents' hf_model in a LoRA run: the save's huggingface/ folder holds what the
    converter's --merge makes from the same checkpoint (the trainer's gathered, merged weights vs
    the base's safetensors with the saved adapters merged); the critic's loads as a token
    classifier whose adapted weights left the base."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForTokenClassification

    setup, run = straight
    merged = _converted(run, tmp_path / "merged", "--merge")
    hf = run / "global_step_4" / "actor" / "huggingface"
    want, got = load_file(str(merged / "model.safetensors")), load_file(str(hf / "model.safetensors"))
    assert set(got) == set(want)
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    assert diff < 1e-6, diff
    base = load_file(str(Path(setup["model"]) / "model.safetensors"))
    assert (got["model.layers.0.self_attn.q_proj.weight"] - base["model.layers.0.self_attn.q_proj.weight"]).abs().max() > 1e-4
    # the policy's adapters beside it, as the converter's PEFT folder of the same checkpoint
    peft = _converted(run, tmp_path / "peft")
    mine = run / "global_step_4" / "actor" / "lora_adapter"
    a, b = load_file(str(mine / "adapter_model.safetensors")), load_file(str(peft / "adapter_model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((mine / "adapter_config.json").read_text()) == json.loads((peft / "adapter_config.json").read_text())
    assert not (run / "global_step_4" / "critic" / "lora_adapter").exists()   # the critic: its merged folder only
    critic_hf = run / "global_step_4" / "critic" / "huggingface"
    assert json.loads((critic_hf / "config.json").read_text())["architectures"][0].endswith("ForTokenClassification")
    model, info = AutoModelForTokenClassification.from_pretrained(str(critic_hf), dtype=torch.float32,
                                                                  output_loading_info=True)
    assert not any(info.values()), info
    critic = load_file(str(critic_hf / "model.safetensors"))
    assert (critic["model.layers.0.mlp.down_proj.weight"] - base["model.layers.0.mlp.down_proj.weight"]).abs().max() > 1e-4


@pytest.mark.e2e
def test_lora_run_from_a_peft_adapter_with_merged_sync(straight, tmp_path):
    """A run starting from a PEFT adapter (the converter's, of the run's last checkpoint), synced
    merged (an engine that serves no adapters): the engine equals the trainer, the whole model
    goes every push, and the KL to the base is there from the first mini-batch (actor lr 0: the
    loaded adapters are all that separates the policy from its reference)."""
    from harness import spawn

    setup, straight_run = straight
    adapter = _converted(straight_run, tmp_path / "adapter")
    run = tmp_path / "merged"
    spawn(_run, 2, setup, str(run), 2, ["trainer.save_freq=-1", f"actor_rollout_ref.model.lora_adapter_path={adapter}",
                                        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                                        "actor_rollout_ref.actor.optim.lr=0"], True)
    full, _ = _sizes(setup["model"])
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["training/rollout_probs_diff_max"] < 1e-4, r
        assert r["rollout/sync_bytes"] == full   # every push: the whole model, adapters merged in
        assert r["actor/kl_loss"] > 1e-4 and r["actor/ppo_kl"] == pytest.approx(0, abs=1e-7)
