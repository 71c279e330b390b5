"""The memory planner (megappo.plan): its counts against a hand count and against a real megatron
model, its verdicts for the shipped recipes, and its command line."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megappo import plan as P

ROOT = Path(__file__).resolve().parents[2]
GiB = 2**30
sys.path.insert(0, str(ROOT / "tests"))
from hub_cache import hub_cache, offline_cache  # noqa: E402,F401

# A small Qwen3-style model, counted by hand below.
SMALL = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000,
         "tie_word_embeddings": False}


def test_parameters_and_bytes_match_a_hand_count():
    m = P.model_shape(SMALL)
    # One layer at TP2: q 64x64/2 = 2048, k and v 64x32/2 = 1024 each, o 64x64/2 = 2048 -> 6144;
    # norms 2x64 + q/k norms 2x16 = 160 (replicated); MLP 3 x 64 x 128 / 2 = 12288. Total 18592.
    assert P._layer_params(m, 2) == 18592
    # Vocabulary padded to a multiple of 128 x TP = 256: 1024; the embedding shard 1024 x 64 / 2 = 32768.
    assert P.padded_vocab_size(1000, 2) == 1024
    # PP2: stage 0 = 2 layers + embedding; stage 1 = 2 layers + final norm + output layer.
    assert P.stage_params(m, 2, 2, 0) == 2 * 18592 + 32768
    assert P.stage_params(m, 2, 2, 1) == 2 * 18592 + 64 + 32768
    assert P.stage_params(m, 2, 2, 1, value_head=True) == 2 * 18592 + 64 + 64 + 1   # head weight + bias
    n0 = 2 * 18592 + 32768
    o = P.PlanOptions(tp=2, pp=2, dp=4, gpu_memory_gb=1.0, vllm_fraction=0.5, micro_batches=8,
                      actor=P.RoleOptions(train_tokens=100, forward_tokens=200))
    p = P.plan(m, o)
    row = p.table[0]["update_actor"]
    assert row["actor weights"] == 2 * n0                   # bf16
    assert row["actor grads"] == 4 * n0                     # fp32 DDP buffer
    assert row["actor optimizer"] == 12 * n0 // 4           # fp32 main + 2 moments, sharded over DP4
    # Saved activations per token per layer at TP2 with SP, bf16, TransformerEngine's spec: rotated
    # q, k (6 x 16 / 2), the qkv output (8 x 16 / 2), the attention output (4 x 16 / 2): 144 x 2 B;
    # fp32 log-sum-exp 4 x 4 / 2 = 8 B; RoPE's cos and sin for q and k 4 x 16 x 2 = 128 B; SwiGLU
    # 5 x 128 / 2 x 2 = 640 B; two fused norms keep input and output (2 x 64 x 2 B) and an fp32
    # 1/rms, over SP: 2 x 260 / 2 = 260 B; q/k norms' 1/rms per head 4 x 6 / 2 = 12 B. 1336 B.
    assert P.layer_activation_bytes_per_token(m, o) == 288 + 8 + 128 + 640 + 260 + 12
    # The local spec's norms keep an fp32 copy, the normalised and the output tensor: 2 x (4 + 2 + 2)
    # x 64 / 2 = 512 B; q/k norms fp32 + bf16 of 6 heads x 16 / 2: 6 x 48 = 288 B.
    local = replace(o, layer_spec="local")
    assert P.layer_activation_bytes_per_token(m, local) == 288 + 8 + 128 + 640 + 512 + 288
    # 2 layers, 100 tokens, PP - 0 = 2 in flight, and the backward's gradients at the SwiGLU:
    # fc1's output and its two halves, 4 x 128 / 2 x 2 B = 512 B per token.
    assert row["activations"] == 1336 * 100 * 2 * 2 + 512 * 100 and row["logits"] == 0
    # the optimizer step's fp32 temporary of the DP4 shard (n0 / 4 x 4 B) is less than the pass
    assert P.optimizer_step_bytes(n0, o, o.actor) == n0 and row["optimizer step"] == 0
    # Last stage: 100 x 512 bf16 logits, their gradient, the output layer's input gradient (100 x
    # 64 x 2 B) and five fp32 [100, 512] temporaries of the kernel: more than the layer's
    # backward, which runs after the logits are freed (so only the kept layers add).
    last = p.table[1]["update_actor"]
    assert last["logits"] == 100 * 512 * 2 * 2 + 100 * 64 * 2 + 100 * 512 * 4 * 5
    assert last["activations"] == 1336 * 100 * 2 * 1
    # Forward only: the logits and two fp32 temporaries (the upcast; 1000 ids padded to 1024: the
    # last TP rank masks its padding), larger than a layer's forward peak (bf16:
    # SwiGLU 5 x 128 / 2, four hidden-sized tensors 4 x 64 / 2) and never alive with it.
    assert p.table[1]["old_log_prob"]["logits"] == 200 * 512 * 2 + 200 * 512 * 4 * 2
    assert p.table[1]["old_log_prob"]["activations"] == 0
    assert p.table[0]["old_log_prob"]["activations"] == 2 * (320 + 128) * 200
    # The local spec under SP all-gathers the output layer's input into megatron's buffer (200 x 64
    # bf16), and each layer's linear inputs likewise: the forward peak adds 64 per token.
    lp = P.plan(m, local)
    assert lp.table[1]["old_log_prob"]["logits"] == 200 * 512 * 2 + 200 * 64 * 2 + 200 * 512 * 4 * 2
    assert lp.table[0]["old_log_prob"]["activations"] == 2 * (320 + 128 + 64) * 200
    assert p.table[0]["rollout"]["vLLM"] == int(0.5 * GiB)
    assert p.table[0]["update_actor"]["vLLM"] == 0            # asleep while training
    # Full recomputation keeps each layer's input (h / TP under SP) and rebuilds one layer, whose
    # backward then adds its gradients.
    rc = P.plan(m, replace(o, actor=replace(o.actor, recompute="full")))
    assert rc.table[0]["update_actor"]["activations"] == 2 * 32 * 100 * 2 * 2 + (1336 + 512) * 100
    # A large optimizer shard (DP1) steps above the recomputed pass: only the excess adds.
    dp1 = P.plan(m, replace(o, dp=1, actor=replace(o.actor, recompute="full")))
    pass0 = dp1.table[0]["update_actor"]["activations"]
    assert dp1.table[0]["update_actor"]["optimizer step"] == 4 * n0 - pass0 > 0
    # Offload: idle roles' state leaves the GPU; an active role's stays.
    off = P.plan(m, replace(o, actor=replace(o.actor, param_offload=True, grad_offload=True, optimizer_offload=True)))
    assert off.table[0]["rollout"]["actor weights"] == 0 and off.table[0]["rollout"]["actor optimizer"] == 0
    assert off.table[0]["update_actor"]["actor weights"] == 2 * n0
    # a forward pass brings back the weights only; the update everything
    assert off.table[0]["old_log_prob"]["actor weights"] == 2 * n0 and off.table[0]["old_log_prob"]["actor grads"] == 0
    assert off.table[0]["update_actor"]["actor optimizer"] == 12 * n0 // 4
    assert off.table[0]["sync"] == {"actor weights": 2 * n0, "actor grads": 0, "actor optimizer": 0,
                                    "vLLM": int(0.5 * GiB)}


def test_context_parallelism_keeps_gathered_keys_and_shards_the_optimizer_over_dp_x_cp():
    m = P.model_shape(SMALL)
    # a role's token counts are per GPU (options_from_config divides a micro-batch by CP)
    o = P.PlanOptions(tp=2, pp=2, dp=4, gpu_memory_gb=1.0, vllm_fraction=0.5, micro_batches=8,
                      actor=P.RoleOptions(train_tokens=100, forward_tokens=200))
    cp = replace(o, cp=2)
    n0 = 2 * 18592 + 32768   # stage 0's parameters (the hand count above)
    one, two = P.plan(m, o).table, P.plan(m, cp).table
    assert two[0]["update_actor"]["actor optimizer"] == 12 * n0 // 8           # DP4 x CP2
    assert two[0]["update_actor"]["actor weights"] == one[0]["update_actor"]["actor weights"]
    assert two[0]["update_actor"]["actor grads"] == one[0]["update_actor"]["actor grads"]
    # the attention keeps the other rank's keys and values too: (2 - 1) x (keys and values) 2 x
    # 2 groups x 16 / TP2 x 2 B = 64 B per own token
    assert P.layer_activation_bytes_per_token(m, cp) == P.layer_activation_bytes_per_token(m, o) + 64
    assert two[0]["update_actor"]["activations"] == (1336 + 64) * 100 * 2 * 2 + 512 * 100
    assert two[1]["update_actor"]["logits"] == one[1]["update_actor"]["logits"]


def test_context_parallelism_from_a_config_splits_micro_batches_and_keeps_token_budgets():
    from megappo.config import load_config

    def opts(*extra):
        return P.options_from_config(load_config(["trainer.n_gpus_per_node=8", "data.max_prompt_length=96",
                                                  "data.max_response_length=32", *extra], ["tiny_cpu"]))

    m = "actor_rollout_ref.actor.megatron."
    fixed, fixed2 = opts(), opts(f"{m}context_parallel_size=2")
    assert (fixed.cp, fixed2.cp, fixed2.dp) == (1, 2, 4)
    # 2 samples of 128 tokens per micro-batch (the preset's): 256 tokens on a GPU, 128 at CP2
    assert (fixed.actor.train_tokens, fixed2.actor.train_tokens) == (256, 128)
    # per GPU a step covers the same tokens: DP 8 x CP 1 or DP 4 x CP 2 GPUs share the batch
    assert fixed2.step_tokens == fixed.step_tokens == 8 * 2 * 128 // 8
    # a token budget is per GPU (as verl's): the same tokens per GPU, so at the same DP (4) a
    # micro-batch holds twice the samples: 8 samples x 128 tokens a rank, 4 micro-batches of 256, 2 at CP2
    dyn = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=256",
           "actor_rollout_ref.actor.ppo_mini_batch_size=16", "data.train_batch_size=16"]
    budget, budget2 = opts(*dyn, "trainer.n_gpus_per_node=4"), opts(*dyn, f"{m}context_parallel_size=2")
    assert (budget.dp, budget2.dp) == (4, 4)
    assert budget.actor.train_tokens == budget2.actor.train_tokens == 256
    assert (budget.micro_batches, budget2.micro_batches) == (4, 2)


@pytest.mark.parametrize("name,billions", [("Qwen3-8B", 8.19), ("Qwen3-14B", 14.77), ("Qwen3-32B", 32.76),
                                           ("Qwen2.5-0.5B", 0.49), ("Qwen3-30B-A3B", 30.53)])
def test_shipped_model_configs_have_their_published_size(name, billions):
    m = P.model_shape(json.loads((P.MODEL_CONFIGS / f"{name}.json").read_text()))
    n = P.stage_params(m, 1, 1, 0)
    assert abs(n / 1e9 - billions) < 0.02 * billions, n


def test_model_configs_are_found_by_name(tmp_path):
    assert P.find_model_config("Qwen/Qwen3-8B").name == "Qwen3-8B.json"
    assert P.find_model_config("~/models/Qwen2.5-0.5B-Instruct").name == "Qwen2.5-0.5B.json"
    assert P.find_model_config("Qwen/Qwen3-30B-A3B-Base").name == "Qwen3-30B-A3B.json"
    (tmp_path / "config.json").write_text("{}")
    assert P.find_model_config(str(tmp_path)) == tmp_path / "config.json"
    with pytest.raises(FileNotFoundError, match="no config.json for model 'Llama-70B'.*--model-config"):
        P.find_model_config("Llama-70B")


def _plan_cli(*args):
    return subprocess.run([sys.executable, "-m", "megappo.plan", *args], capture_output=True, text=True, cwd=ROOT)


NO_OFFLOAD = [f"{s}.megatron.{k}=False" for s in ("actor_rollout_ref.actor", "critic")
              for k in ("param_offload", "grad_offload", "optimizer_offload")] + ["actor_rollout_ref.ref.megatron.param_offload=False"]


@pytest.mark.parametrize("recipe", ["qwen3_8b", "qwen3_14b", "qwen3_32b"])
@pytest.mark.parametrize("gpu", [80, 141])
def test_recipes_fit_with_their_defaults(recipe, gpu):
    r = _plan_cli("--config", f"parallel_configs/{recipe}.yaml", f"trainer.gpu_memory_gb={gpu}")
    assert r.returncode == 0 and ": FITS" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("recipe,gpu,fits", [("qwen3_8b", 80, False), ("qwen3_8b", 141, True), ("qwen3_14b", 80, False),
                                             ("qwen3_32b", 80, False), ("qwen3_32b", 141, True)])
def test_recipes_without_offload(recipe, gpu, fits):
    """Without offload, the idle roles' weights, gradients and Adam state stay on the GPU beside
    vLLM's share during rollout: more than 80 GiB for every recipe; a 141 GiB GPU holds them."""
    r = _plan_cli("--config", f"parallel_configs/{recipe}.yaml", f"trainer.gpu_memory_gb={gpu}", *NO_OFFLOAD)
    assert (": FITS" in r.stdout) == fits and r.returncode == (0 if fits else 1), r.stdout + r.stderr
    if not fits:
        assert "peak" in r.stdout and "(stage" in r.stdout and "rollout)" in r.stdout, r.stdout
        assert "cheapest fix: offload" in r.stdout, r.stdout


def test_without_recomputation_the_update_is_the_peak():
    """With offload the rollout is light; the update's activations then set the peak: at a 12k-token
    budget it fits on stage 0 (two micro-batches in flight); at the recipe's 24k (78 GiB of
    activations: megatron's unfused SwiGLU keeps 5 x FFN per token) it needs recomputation on 80 GiB."""
    off = "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=null"
    r = _plan_cli("--config", "parallel_configs/qwen3_8b.yaml", "trainer.gpu_memory_gb=80", off,
                  "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=12288")
    assert r.returncode == 0 and "(stage 0, update_actor) of 77.0 GiB usable: FITS" in r.stdout, r.stdout
    r = _plan_cli("--config", "parallel_configs/qwen3_8b.yaml", "trainer.gpu_memory_gb=80", off)
    assert r.returncode == 1 and "(stage 0, update_actor) of 77.0 GiB usable: DOES NOT FIT" in r.stdout, r.stdout
    assert "cheapest fix: full activation recomputation" in r.stdout, r.stdout


def test_cli_errors_name_the_problem():
    r = _plan_cli("actor_rollout_ref.model.path=/nope/Llama-70B")
    assert r.returncode == 2 and "no config.json for model '/nope/Llama-70B'" in r.stderr, r.stderr
    r = _plan_cli("trainer.gpu_memory_gb=abc")
    assert r.returncode == 2 and "trainer.gpu_memory_gb" in r.stderr, r.stderr


QWEN05 = (P.MODEL_CONFIGS / "Qwen2.5-0.5B.json").read_text()


def test_hub_id_plans_from_the_cached_config_offline(tmp_path):
    """HF_HOME's hub cache, offline: the id's cached config.json is used (not a shipped one)."""
    import os

    snap = hub_cache(tmp_path / "home" / "hub", "someorg/Qwen3-8B-small", files={"config.json": QWEN05})
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    run = [sys.executable, "-m", "megappo.plan", "trainer.gpu_memory_gb=80"]
    r = subprocess.run(run + ["actor_rollout_ref.model.path=someorg/Qwen3-8B-small"], capture_output=True,
                       text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"model config: {snap / 'config.json'}" in r.stdout and "memory plan: someorg/Qwen3-8B-small (0.49B" in r.stdout
    r = subprocess.run(run + ["actor_rollout_ref.model.path=someorg/missing@v2"], capture_output=True, text=True,
                       cwd=ROOT, env=env)
    assert r.returncode == 2 and "someorg/missing@v2: config.json is not in the HF cache" in r.stderr, r.stderr


def test_hub_id_downloads_config_json_only(offline_cache, monkeypatch, capsys):
    """Online, an id neither cached nor shipped: one download, of config.json alone; never weights
    (no snapshot_download at all). A Qwen id without a revision plans from the shipped config
    unless the cache has the id's own."""
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    real, asked = huggingface_hub.hf_hub_download, []

    def fake_file(repo, filename, local_files_only=False, cache_dir=None, **kw):
        if local_files_only:
            return real(repo, filename, local_files_only=True, cache_dir=cache_dir, **kw)
        asked.append((repo, filename, kw.get("revision")))
        snap = hub_cache(Path(cache_dir), repo, files={filename: QWEN05}, listed=False, ref=kw.get("revision") or "main")
        return str(snap / filename)

    def no_snapshot(*a, **kw):
        raise AssertionError(f"the planner asked for a whole snapshot: {a} {kw}")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_file)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_snapshot)
    assert P.main(["actor_rollout_ref.model.path=org/tiny@v1", "trainer.gpu_memory_gb=80"]) == 0
    assert asked == [("org/tiny", "config.json", "v1")]
    assert "memory plan: org/tiny (0.49B" in capsys.readouterr().out
    assert P.main(["actor_rollout_ref.model.path=org/tiny@v1", "trainer.gpu_memory_gb=80"]) == 0
    assert len(asked) == 1                                   # cached now: no second download
    assert P.find_model_config("Qwen/Qwen3-8B") == P.MODEL_CONFIGS / "Qwen3-8B.json" and len(asked) == 1
    # another org's model named like a shipped one may differ from it (a fine-tune's vocabulary): its own config
    assert P.find_model_config("someorg/Qwen3-8B-ft").parent.parent.parent.name == "models--someorg--Qwen3-8B-ft"
    assert asked[-1] == ("someorg/Qwen3-8B-ft", "config.json", None)
    snap = hub_cache(offline_cache, "Qwen/Qwen3-8B", files={"config.json": QWEN05})
    assert P.find_model_config("Qwen/Qwen3-8B") == snap / "config.json"   # the cached one wins over the shipped one


def test_defaults_follow_the_kernels_and_the_device(monkeypatch):
    from megappo.config import load_config
    from megappo.distributed import LOGITS_CHUNK_TOKENS

    assert P.PlanOptions().logits_chunk_tokens == LOGITS_CHUNK_TOKENS
    cfg = load_config([], [str(ROOT / "parallel_configs" / "qwen3_8b.yaml")])
    monkeypatch.setattr(P, "device_memory_gb", lambda: None)
    assert P.options_from_config(cfg).gpu_memory_gb == 80.0          # no GPU here: 80 GiB
    monkeypatch.setattr(P, "device_memory_gb", lambda: 139.8)
    assert P.options_from_config(cfg).gpu_memory_gb == 139.8         # the device's
    cfg.trainer.gpu_memory_gb = 40.0
    assert P.options_from_config(cfg).gpu_memory_gb == 40.0          # the config wins
