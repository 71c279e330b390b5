"""Config tree: verl defaults, typed overrides, YAML presets, ${} references, validation rules."""
import os
from pathlib import Path

import pytest
import yaml

from megappo import config as C
from megappo.config import ConfigError, load_config, validate

REPO = Path(__file__).resolve().parents[2]


def keys_of(err: ConfigError) -> list[str]:
    return [k for k, _ in err.errors]


def fails(overrides, *, files=("tiny_cpu",), **kw) -> ConfigError:
    """Load + validate; return the ConfigError (the test fails if there is none)."""
    with pytest.raises(ConfigError) as ei:
        cfg = load_config(overrides, files)
        validate(cfg, **kw)
    return ei.value


def ok(overrides=(), files=("tiny_cpu",), **kw) -> C.PPOConfig:
    cfg = load_config(overrides, files)
    validate(cfg, **kw)
    return cfg


# ------------------------------------------------------------------------------------------
# defaults
# ------------------------------------------------------------------------------------------

VERL_DEFAULTS = {
    "data.train_batch_size": 1024,
    "data.max_prompt_length": 512,
    "data.max_response_length": 512,
    "data.filter_overlong_prompts": False,
    "data.truncation": "error",
    "data.shuffle": True,
    "data.prompt_key": "prompt",
    "actor_rollout_ref.actor.ppo_mini_batch_size": 256,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": None,
    "actor_rollout_ref.actor.use_dynamic_bsz": False,
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.actor.ppo_epochs": 1,
    "actor_rollout_ref.actor.clip_ratio": 0.2,
    "actor_rollout_ref.actor.clip_ratio_c": 3.0,
    "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
    "actor_rollout_ref.actor.entropy_coeff": 0.0,
    "actor_rollout_ref.actor.use_kl_loss": False,
    "actor_rollout_ref.actor.kl_loss_coef": 0.001,
    "actor_rollout_ref.actor.kl_loss_type": "low_var_kl",
    "actor_rollout_ref.actor.optim.lr": 1e-6,
    "actor_rollout_ref.actor.optim.weight_decay": 0.01,
    "actor_rollout_ref.actor.optim.clip_grad": 1.0,
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 1,
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": 1,
    "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size": None,
    "actor_rollout_ref.actor.megatron.sequence_parallel": True,
    "actor_rollout_ref.rollout.name": "vllm",
    "actor_rollout_ref.rollout.n": 1,
    "actor_rollout_ref.rollout.temperature": 1.0,
    "actor_rollout_ref.rollout.top_p": 1.0,
    "actor_rollout_ref.rollout.top_k": -1,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
    "actor_rollout_ref.rollout.gpu_memory_utilization": 0.5,
    "actor_rollout_ref.rollout.enforce_eager": True,
    "actor_rollout_ref.rollout.free_cache_engine": True,
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 16384,
    "actor_rollout_ref.rollout.val_kwargs.temperature": 0.0,
    "actor_rollout_ref.rollout.val_kwargs.n": 1,
    "actor_rollout_ref.rollout.val_kwargs.do_sample": False,
    "critic.optim.lr": 1e-5,
    "critic.ppo_mini_batch_size": 256,
    "critic.ppo_epochs": 1,
    "critic.cliprange_value": 0.5,
    "critic.ppo_max_token_len_per_gpu": 32768,
    "algorithm.gamma": 1.0,
    "algorithm.lam": 1.0,
    "algorithm.adv_estimator": "gae",
    "algorithm.norm_adv_by_std_in_grpo": True,
    "algorithm.use_kl_in_reward": False,
    "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed",
    "algorithm.kl_ctrl.kl_coef": 0.001,
    "algorithm.kl_ctrl.horizon": 10000,
    "algorithm.kl_ctrl.target_kl": 0.1,
    "trainer.nnodes": 1,
    "trainer.n_gpus_per_node": 8,
    "trainer.total_epochs": 30,
    "trainer.total_training_steps": None,
    "trainer.save_freq": -1,
    "trainer.test_freq": -1,
    "trainer.resume_mode": "auto",
    "trainer.balance_batch": True,
    "trainer.device": "cuda",
}


def test_defaults_are_verls():
    cfg = load_config()
    for key, want in VERL_DEFAULTS.items():
        assert C.get(cfg, key) == want, key
    # clip_ratio_low/high follow clip_ratio (verl hard-codes 0.2 and ignores a changed clip_ratio)
    assert cfg.actor_rollout_ref.actor.clip_ratio_low is None
    assert cfg.trainer.default_local_dir == "checkpoints/megappo/default"


def test_every_key_documented_and_listed():
    keys = C.all_keys()
    assert len(keys) == len(set(keys))
    for key in VERL_DEFAULTS:
        assert key in keys
    table = C.config_reference_markdown()
    for key in keys:
        assert f"| `{key}` |" in table


# ------------------------------------------------------------------------------------------
# overrides of every type
# ------------------------------------------------------------------------------------------

def test_overrides_are_typed():
    cfg = load_config([
        "data.train_batch_size=64",                         # int
        "actor_rollout_ref.actor.optim.lr=3e-6",            # float in exponent form
        "actor_rollout_ref.actor.clip_ratio=0.28",          # float
        "algorithm.gamma=1",                                # int text for a float field
        "actor_rollout_ref.actor.use_kl_loss=True",         # bool, Python spelling
        "data.shuffle=false",                               # bool, YAML spelling
        "data.train_files=[a.parquet, 'b c.parquet']",      # list
        "data.val_files=only.parquet",                      # one value for a list field
        "actor_rollout_ref.actor.optim.betas=[0.9,0.95]",   # list of floats
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.total_training_steps=null",                # null for an Optional
        "critic.enable=None",
        "data.truncation=left",                             # one of a fixed set
        "trainer.experiment_name='my run'",                 # quoted string
        "trainer.logger=[console,tensorboard]",
        "+trainer.project_name=p",                          # hydra's '+' is accepted
    ], ())
    assert cfg.data.train_batch_size == 64 and type(cfg.data.train_batch_size) is int
    assert cfg.actor_rollout_ref.actor.optim.lr == pytest.approx(3e-6)
    assert cfg.actor_rollout_ref.actor.clip_ratio == 0.28
    assert cfg.algorithm.gamma == 1.0 and type(cfg.algorithm.gamma) is float
    assert cfg.actor_rollout_ref.actor.use_kl_loss is True
    assert cfg.data.shuffle is False
    assert cfg.data.train_files == ["a.parquet", "b c.parquet"]
    assert cfg.data.val_files == ["only.parquet"]
    assert cfg.actor_rollout_ref.actor.optim.betas == [0.9, 0.95]
    assert cfg.trainer.total_training_steps is None
    assert cfg.critic.enable is None
    assert cfg.data.truncation == "left"
    assert cfg.trainer.experiment_name == "my run"
    assert cfg.trainer.logger == ["console", "tensorboard"]
    assert cfg.trainer.default_local_dir == "checkpoints/p/my run"


@pytest.mark.parametrize("override, key, fragment", [
    ("data.train_batch_size=0.5", "data.train_batch_size", "expected an integer, got '0.5'"),
    ("data.train_batch_size=abc", "data.train_batch_size", "expected an integer"),
    ("data.shuffle=maybe", "data.shuffle", "expected a boolean"),
    ("actor_rollout_ref.actor.optim.lr=fast", "actor_rollout_ref.actor.optim.lr", "expected a number"),
    ("data.train_batch_size=null", "data.train_batch_size", "null is not allowed"),
    ("data.truncation=middle-out", "data.truncation", "one of 'error', 'left', 'right', 'middle'"),
    ("trainer.logger=[console,wandb]", "trainer.logger", "one of 'console', 'tensorboard', 'file'"),
    ("actor_rollout_ref.actor.optim.betas=[0.9, x]", "actor_rollout_ref.actor.optim.betas", "expected a number"),
    ("data=3", "data", "is a section"),
])
def test_type_errors_name_key_and_expectation(override, key, fragment):
    with pytest.raises(ConfigError) as ei:
        load_config([override], ())
    assert ei.value.errors[0][0] == key
    assert fragment in ei.value.errors[0][1]
    assert key in str(ei.value)


def test_override_without_equals():
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(["data.train_batch_size"], ())


@pytest.mark.parametrize("typo, suggestion", [
    ("actor_rollout_ref.actor.clip_ratoi", "actor_rollout_ref.actor.clip_ratio"),
    ("actor.clip_ratio", "actor_rollout_ref.actor.clip_ratio"),
    ("data.train_batchsize", "data.train_batch_size"),
    ("algorithm.kl_ctrl.kl_coeff", "algorithm.kl_ctrl.kl_coef"),
    ("trainer.n_gpu_per_node", "trainer.n_gpus_per_node"),
    ("actor_rollout_ref.rollout.tensor_parallel_size", "actor_rollout_ref.rollout.tensor_model_parallel_size"),
])
def test_unknown_key_suggests_closest(typo, suggestion):
    with pytest.raises(ConfigError) as ei:
        load_config([f"{typo}=1"], ())
    msg = str(ei.value)
    assert f"unknown config key '{typo}'" in msg
    assert f"'{suggestion}'" in msg


def test_value_used_as_section_is_an_error():
    with pytest.raises(ConfigError, match="'data.seed' is a value, not a section"):
        load_config(["data.seed.x=1"], ())


# ------------------------------------------------------------------------------------------
# ${...} references
# ------------------------------------------------------------------------------------------

def test_inherited_keys_follow_the_actor_unless_set():
    cfg = load_config(["actor_rollout_ref.actor.ppo_mini_batch_size=32", "actor_rollout_ref.actor.ppo_epochs=2",
                       "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"], ())
    assert cfg.critic.ppo_mini_batch_size == 32
    assert cfg.critic.ppo_epochs == 2
    assert cfg.critic.megatron.tensor_model_parallel_size == 4
    assert cfg.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 4
    assert cfg.critic.model.path == cfg.actor_rollout_ref.model.path
    cfg = load_config(["actor_rollout_ref.actor.ppo_mini_batch_size=32", "critic.ppo_mini_batch_size=8"], ())
    assert cfg.critic.ppo_mini_batch_size == 8


def test_explicit_reference_override_is_typed():
    cfg = load_config(["data.max_response_length=100", "actor_rollout_ref.actor.ppo_epochs=${data.max_response_length}"], ())
    assert cfg.actor_rollout_ref.actor.ppo_epochs == 100
    with pytest.raises(ConfigError, match="expected an integer"):
        load_config(["actor_rollout_ref.actor.ppo_epochs=${actor_rollout_ref.actor.clip_ratio}"], ())


def test_reference_errors():
    with pytest.raises(ConfigError, match="circular reference"):
        load_config(["data.seed=${data.train_batch_size}", "data.train_batch_size=${data.seed}"], ())
    with pytest.raises(ConfigError, match="unknown config key 'data.nope'"):
        load_config(["data.seed=${data.nope}"], ())


# ------------------------------------------------------------------------------------------
# YAML presets
# ------------------------------------------------------------------------------------------

def test_yaml_nested_dotted_and_override_order(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(
        "data:\n  train_batch_size: 16\n  max_prompt_length: 100\n"
        "actor_rollout_ref.actor.optim.lr: 1e-6\n"           # YAML 1.1 reads this as a string
        "actor_rollout_ref.actor.optim.weight_decay: 0\n"     # int for a float field
        "trainer:\n  logger: console\n")
    g = tmp_path / "q.yaml"
    g.write_text("data:\n  max_prompt_length: 200\n")
    cfg = load_config(["data.train_batch_size=32"], [str(f), str(g)])
    assert cfg.data.train_batch_size == 32          # the command line wins
    assert cfg.data.max_prompt_length == 200        # later files win
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-6
    assert cfg.actor_rollout_ref.actor.optim.weight_decay == 0.0
    assert cfg.trainer.logger == ["console"]


def test_yaml_errors_name_file_and_key(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("data:\n  train_batch_sise: 16\n  shuffle: sometimes\n")
    with pytest.raises(ConfigError) as ei:
        load_config([], [str(f)])
    msg = str(ei.value)
    assert "data.train_batch_sise" in msg and "'data.train_batch_size'" in msg and str(f) in msg
    assert "data.shuffle" in msg and "expected a boolean" in msg
    f.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config([], [str(f)])
    f.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config([], [str(f)])
    with pytest.raises(ConfigError, match="not found .*built-in presets: .*tiny_cpu"):
        load_config([], [str(tmp_path / "missing.yaml")])


def test_builtin_preset_by_name():
    cfg = load_config([], ["tiny_cpu"])
    assert cfg.trainer.device == "cpu"
    validate(cfg)


# ------------------------------------------------------------------------------------------
# validation rules: each names its key path
# ------------------------------------------------------------------------------------------

TINY_TP2PP2 = ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
               "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2"]


@pytest.mark.parametrize("overrides, key, fragment", [
    (["trainer.n_gpus_per_node=3", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"],
     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size", "must be divisible by TP x PP = 2 x 1"),
    (["critic.megatron.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=4"],
     "critic.megatron.tensor_model_parallel_size", "share one megatron parallel state"),
    (["actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2", "trainer.n_gpus_per_node=4"],
     "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size", "must equal"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=4", "trainer.n_gpus_per_node=2"],
     "actor_rollout_ref.rollout.tensor_model_parallel_size", "divisible by the rollout TP size 4"),
    (["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"],
     "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size > 1"),
    (["data.train_batch_size=6"], "actor_rollout_ref.actor.ppo_mini_batch_size",
     "train_batch_size (6) must be divisible by actor_rollout_ref.actor.ppo_mini_batch_size (4)"),
    (["trainer.n_gpus_per_node=3"], "actor_rollout_ref.actor.ppo_mini_batch_size",
     "must split evenly over 3 data-parallel ranks"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3"], "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
     "divisible by the micro-batch size 3"),
    (["critic.ppo_micro_batch_size_per_gpu=3"], "critic.ppo_micro_batch_size_per_gpu", "micro-batch size 3"),
    (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null"], "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
     "must be set when actor_rollout_ref.actor.use_dynamic_bsz is false"),
    (["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=null"],
     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "must be set when"),
    (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=50"],
     "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "smaller than one sequence"),
    (["actor_rollout_ref.actor.clip_ratio_c=0.5"], "actor_rollout_ref.actor.clip_ratio_c", "must be > 1"),
    (["actor_rollout_ref.actor.clip_ratio_c=1.0"], "actor_rollout_ref.actor.clip_ratio_c", "must be > 1"),
    (["actor_rollout_ref.actor.kl_loss_type=k4"], "actor_rollout_ref.actor.kl_loss_type", "unknown KL estimator 'k4'"),
    (["algorithm.kl_penalty=full+"], "algorithm.kl_penalty", "supported: kl, k1"),
    (["algorithm.adv_estimator=ppo2"], "algorithm.adv_estimator", "registered: gae, grpo"),
    (["critic.enable=false"], "critic.enable", "needs a critic"),
    (["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n",
     "needs rollout.n > 1"),
    (["algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n", "n > 1"),
    (["trainer.save_freq=0"], "trainer.save_freq", "-1 (disabled) or a positive number"),
    (["trainer.test_freq=-5"], "trainer.test_freq", "-1 (disabled)"),
    (["trainer.resume_mode=resume_path"], "trainer.resume_from_path", "must be set"),
    (["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0"], "algorithm.kl_ctrl.target_kl", "target_kl > 0"),
    (["algorithm.lam=1.5"], "algorithm.lam", "[0, 1]"),
    (["actor_rollout_ref.rollout.top_p=0"], "actor_rollout_ref.rollout.top_p", "(0, 1]"),
    (["actor_rollout_ref.rollout.top_k=0"], "actor_rollout_ref.rollout.top_k", "-1 (disabled) or >= 1"),
    (["actor_rollout_ref.rollout.val_kwargs.temperature=-1"], "actor_rollout_ref.rollout.val_kwargs.temperature", ">= 0"),
    (["actor_rollout_ref.rollout.gpu_memory_utilization=1.5"], "actor_rollout_ref.rollout.gpu_memory_utilization", "(0, 1]"),
    (["data.train_batch_size=0"], "data.train_batch_size", "positive integer"),
    (["critic.cliprange_value=0"], "critic.cliprange_value", "> 0"),
    (["actor_rollout_ref.actor.optim.betas=[0.9]"], "actor_rollout_ref.actor.optim.betas", "two numbers"),
])
def test_each_rule_names_its_key(overrides, key, fragment):
    err = fails(overrides)
    assert key in keys_of(err), err
    msg = dict(err.errors)[key]
    assert fragment in msg, msg


def test_valid_layouts_pass():
    ok(TINY_TP2PP2)
    ok(TINY_TP2PP2 + ["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"])
    ok(["actor_rollout_ref.actor.kl_loss_type=low_var_kl+", "algorithm.kl_penalty=k1+"])
    ok(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4"])
    ok(["algorithm.adv_estimator=grpo_vectorized", "actor_rollout_ref.rollout.n=4"])
    ok(["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=null"])


def test_grpo_skips_critic_rules_and_warns_when_forced():
    # Without a critic its batch rules do not apply.
    ok(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "critic.ppo_micro_batch_size_per_gpu=null"])
    warnings = []
    ok(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "critic.enable=true"], warnings=warnings)
    assert any("critic.enable=true" in w for w in warnings)


def test_rollout_tp_across_nodes_warns():
    warnings = []
    ok(["trainer.nnodes=2", "trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
        "data.train_batch_size=8"], warnings=warnings)
    assert any("cross nodes" in w for w in warnings)


def test_launcher_world_size_must_match():
    err = fails([], world_size=4)
    assert "trainer.n_gpus_per_node" in keys_of(err)
    assert "WORLD_SIZE=4" in str(err)
    ok([], world_size=2)


def test_all_broken_rules_reported_together():
    err = fails(["actor_rollout_ref.actor.clip_ratio_c=0.5", "trainer.save_freq=0", "algorithm.adv_estimator=nope",
                 "trainer.n_gpus_per_node=3"])
    ks = keys_of(err)
    for k in ("actor_rollout_ref.actor.clip_ratio_c", "trainer.save_freq", "algorithm.adv_estimator",
              "actor_rollout_ref.actor.ppo_mini_batch_size"):
        assert k in ks
    assert str(err).startswith(f"{len(ks)} configuration errors:")


def test_paths_checked_only_on_a_real_start(tmp_path):
    ok()  # the dry-run rules ignore paths
    err = fails([], check_paths=True)
    for k in ("data.train_files", "data.val_files", "actor_rollout_ref.model.path"):
        assert k in keys_of(err)
    train, test = tmp_path / "train.parquet", tmp_path / "test.parquet"
    train.write_bytes(b"x")
    test.write_bytes(b"x")
    model = tmp_path / "model"
    model.mkdir()
    base = [f"data.train_files={train}", f"data.val_files={test}", f"actor_rollout_ref.model.path={model}"]
    err = fails(base, check_paths=True)
    assert "has no config.json" in dict(err.errors)["actor_rollout_ref.model.path"]
    (model / "config.json").write_text("{}")
    ok(base, check_paths=True)
    err = fails(base + ["critic.model.path=/nonexistent/critic"], check_paths=True)
    assert keys_of(err) == ["critic.model.path"]
    ok(base + ["actor_rollout_ref.model.path=Qwen/Qwen3-8B"], check_paths=True)  # a hub id is resolved later


# ------------------------------------------------------------------------------------------
# parallel_configs/: every layout loads and validates for the world size it is meant for
# ------------------------------------------------------------------------------------------

PARALLEL_CONFIGS = sorted((REPO / "parallel_configs").glob("*.yaml"))


def test_parallel_configs_exist():
    assert len(PARALLEL_CONFIGS) >= 4


@pytest.mark.parametrize("path", PARALLEL_CONFIGS, ids=lambda p: p.name)
def test_parallel_config_validates(path):
    raw = yaml.safe_load(path.read_text())
    cfg = load_config([], [str(path)])
    world = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    validate(cfg, world_size=world)
    # each preset states its layout explicitly, not by accident of the defaults
    assert "megatron" in raw["actor_rollout_ref"]["actor"]
    lay = C.parallel_layout(cfg)
    assert lay.tp * lay.pp * lay.dp == world


def test_custom_reward_function_path_checked_on_real_start(tmp_path):
    err = fails([f"custom_reward_function.path={tmp_path}/nope.py"], check_paths=True)
    assert "file not found" in dict(err.errors)["custom_reward_function.path"]
    ok([f"custom_reward_function.path={tmp_path}/nope.py"])  # the dry run does not look
