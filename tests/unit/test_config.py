"""Config tree: verl defaults, typed overrides, YAML presets, ${} references, validation rules."""
import json
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from megappo import config as C
from megappo.config import ConfigError, PPOConfig, load_config, validate

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
    "actor_rollout_ref.rollout.enforce_eager": None,   # verl: true; megappo: CUDA graphs on GPU, eager on CPU
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
    "actor_rollout_ref.model.lora_rank": 0,
    "actor_rollout_ref.model.lora_alpha": 16,
    "actor_rollout_ref.model.exclude_modules": None,
    "actor_rollout_ref.model.lora_adapter_path": None,
    "critic.model.lora_rank": 0,
    "critic.model.lora_alpha": 16,
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
    ("trainer.logger=[console,neptune]", "trainer.logger", "one of 'console', 'tensorboard', 'file', 'wandb', 'mlflow'"),
    ("actor_rollout_ref.actor.optim.betas=[0.9, x]", "actor_rollout_ref.actor.optim.betas", "expected a number"),
    ("data=3", "data", "is a section"),
    ("data.train_batch_size=[1,2]", "data.train_batch_size", "expected an integer, got '[1,2]'"),     # list for a scalar
    ("data.train_batch_size=1e3", "data.train_batch_size", "expected an integer, got '1e3'"),
    ("actor_rollout_ref.actor.clip_ratio=[0.2]", "actor_rollout_ref.actor.clip_ratio", "expected a number"),
    ("actor_rollout_ref.actor.optim.lr=nan", "actor_rollout_ref.actor.optim.lr", "expected a number, got 'nan'"),
    ("data.val_batch_size=many", "data.val_batch_size", "expected an integer"),
    ("data.train_files=[a.parquet", "data.train_files", "cannot parse '[a.parquet' as a list"),
    ("trainer.device=tpu", "trainer.device", "expected one of 'cuda', 'cpu', got 'tpu'"),
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
    assert keys_of(ei.value) == [typo]     # the error's key path is the bad key itself


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


def test_mapping_keys_take_verls_forms(tmp_path):
    """A mapping key (arguments handed on: data.apply_chat_template_kwargs,
    custom_reward_function.reward_kwargs) is set whole, entry by entry (values typed as YAML reads
    them, nested entries made on the way) or from files, which merge as Hydra's do; it travels in the
    saved YAML; a value that is not a mapping, or an entry under a plain value, names the key."""
    f = tmp_path / "p.yaml"
    f.write_text("data:\n  apply_chat_template_kwargs: {enable_thinking: true, a: 1}\n"
                 "custom_reward_function.reward_kwargs:\n  scale: 2\n")
    g = tmp_path / "q.yaml"
    g.write_text("data:\n  apply_chat_template_kwargs:\n    a: 2\n")
    cfg = load_config(["data.apply_chat_template_kwargs.enable_thinking=False",
                       "custom_reward_function.reward_kwargs.opts.mode=strict",
                       "+custom_reward_function.reward_kwargs.opts.n=3"], [str(f), str(g)])
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False, "a": 2}
    assert cfg.custom_reward_function.reward_kwargs == {"scale": 2, "opts": {"mode": "strict", "n": 3}}
    cfg = load_config(["custom_reward_function.reward_kwargs={x: [1, 2], y: null}"])
    assert cfg.custom_reward_function.reward_kwargs == {"x": [1, 2], "y": None}
    assert PPOConfig().data.apply_chat_template_kwargs == {} and PPOConfig().data.apply_chat_template_kwargs \
        is not PPOConfig().data.apply_chat_template_kwargs                 # no default shared between configs
    again = load_config([], [str(_saved(tmp_path, cfg))])
    assert again.custom_reward_function.reward_kwargs == {"x": [1, 2], "y": None}
    for override, fragment in (("data.apply_chat_template_kwargs=3", "expected a mapping"),
                               ("data.apply_chat_template_kwargs=[a]", "expected a mapping"),
                               ("custom_reward_function.reward_kwargs.x=1", None)):
        if fragment is None:
            load_config([override])
            continue
        with pytest.raises(ConfigError) as ei:
            load_config([override])
        assert ei.value.errors[0][0] == override.split("=")[0] and fragment in ei.value.errors[0][1]
    with pytest.raises(ConfigError, match="custom_reward_function.reward_kwargs.x.y: 'x' holds a value"):
        load_config(["custom_reward_function.reward_kwargs.x=1", "custom_reward_function.reward_kwargs.x.y=2"])
    # entries read as OmegaConf reads them (1e-3 a number, on/yes text), references resolved
    f.write_text("custom_reward_function:\n  reward_kwargs: {lr: 1e-3, mode: on, n: '${data.max_response_length}'}\n")
    cfg = load_config(["custom_reward_function.reward_kwargs.tag=len ${data.max_prompt_length}",
                       "custom_reward_function.reward_kwargs.eps=2e-5", "custom_reward_function.reward_kwargs.flag=yes"],
                      ["tiny_cpu", str(f)])
    assert cfg.custom_reward_function.reward_kwargs == {"lr": 0.001, "mode": "on", "n": 32, "tag": "len 64",
                                                        "eps": 2e-5, "flag": "yes"}
    with pytest.raises(ConfigError, match="custom_reward_function.reward_kwargs: unknown config key 'data.nope'"):
        load_config(["custom_reward_function.reward_kwargs.n=${data.nope}"])


def _saved(tmp_path, cfg):
    from megappo.config.parse import to_yaml

    out = tmp_path / "saved.yaml"
    out.write_text(to_yaml(cfg))
    return out


def test_yaml_errors_name_file_and_key(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("data:\n  train_batch_sise: 16\n  shuffle: sometimes\n")
    with pytest.raises(ConfigError) as ei:
        load_config([], [str(f)])
    msg = str(ei.value)
    assert "data.train_batch_sise" in msg and "'data.train_batch_size'" in msg and str(f) in msg
    assert "data.shuffle" in msg and "expected a boolean" in msg
    errs = dict(ei.value.errors)
    assert errs["data.train_batch_sise"].endswith(f"(in {f}, line 2)")
    assert errs["data.shuffle"] == f"expected a boolean (true/false), got 'sometimes' (in {f}, line 3)"
    f.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config([], [str(f)])
    f.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config([], [str(f)])


@pytest.mark.parametrize("text, key, want", [
    ("data:\n  train_batch_size: abc\n", "data.train_batch_size", "expected an integer, got 'abc' (in {f}, line 2)"),
    ("data:\n  max_prompt_length: [64, 128]\n", "data.max_prompt_length", "expected an integer, got [64, 128] (in {f}, line 2)"),
    ("data:\n  train_batch_size: {a: 1}\n", "data.train_batch_size", "expected an integer, got {{'a': 1}} (in {f}, line 2)"),
    ("trainer:\n  n_gpus_per_node: 2\n  logger: [console, neptune]\n", "trainer.logger",
     "one of 'console', 'tensorboard', 'file'"),
    ("actor_rollout_ref.model.path: [a, b]\n", "actor_rollout_ref.model.path", "expected a string, got ['a', 'b'] (in {f}, line 1)"),
    ("algorithm:\n  kl_ctrl: fixed\n", "algorithm.kl_ctrl", "'algorithm.kl_ctrl' is a section"),
    ("data:\n  shuffle: true\ntrainer:\n  n_gpu_per_node: 2\n", "trainer.n_gpu_per_node",
     "unknown config key 'trainer.n_gpu_per_node'; did you mean 'trainer.n_gpus_per_node'? (in {f}, line 4)"),
])
def test_yaml_type_errors_name_file_key_and_line(tmp_path, text, key, want):
    f = tmp_path / "preset.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config([], [str(f)])
    errs = dict(ei.value.errors)
    assert key in errs, ei.value
    assert want.format(f=f) in errs[key]
    assert str(f) in errs[key]


@pytest.mark.parametrize("text, want", [
    ("data:\n  a: [unclosed\n  b: 2\n",
     "line 3, column 4: expected ',' or ']', but got ':' (while parsing a flow sequence started at line 2)"),
    ("data:\n  train_batch_size: 8\n max_prompt_length: 64\n", "line 3, column 2: "),
    ("trainer:\n\tnnodes: 1\n", "line 2, column 1: found character '\\t' that cannot start any token"),
    ("a: 1\n b: 2\n", "line 2, column 3: mapping values are not allowed here"),
])
def test_invalid_yaml_syntax_names_file_and_line(tmp_path, text, want):
    f = tmp_path / "broken.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_config([], [str(f)])
    (key, msg), = ei.value.errors
    assert key == "--config"
    assert msg.startswith(f"cannot parse '{f}' as YAML: ") and want in msg, msg
    assert "\n" not in msg                 # one line per problem


def test_yaml_not_utf8_names_file_and_line(tmp_path):
    f = tmp_path / "latin1.yaml"
    f.write_bytes(b"trainer:\n  experiment_name: caf\xe9\n")
    with pytest.raises(ConfigError) as ei:
        load_config([], [str(f)])
    assert ei.value.errors == [("--config", f"cannot parse '{f}': line 2 is not UTF-8 text (byte 0xe9 at offset 31)")]
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


A = "actor_rollout_ref.actor."
RC = "algorithm.rollout_correction."
R = "actor_rollout_ref.rollout."
WS = dict(world_size=6)          # validate(..., world_size=6): the launcher's WORLD_SIZE
PATHS = dict(check_paths=True)   # a real start: files and folders must exist
# On a real start the table's overrides are formatted with tmp=<a folder holding train.parquet,
# test.parquet, model/config.json, ckpt/ and reward.py>; GOOD_PATHS makes those keys valid.
GOOD_PATHS = ["data.train_files={tmp}/train.parquet", "data.val_files={tmp}/test.parquet",
              "actor_rollout_ref.model.path={tmp}/model"]

# One row per rule of validate(): (overrides on the tiny_cpu preset, validate kwargs, the key the
# error must name, a fragment of its message saying what was expected). test_every_need_site_has_a_row
# checks that every need(...) call in validate() fails for at least one row.
RULES = [
    # -- positive sizes (every key of the two loops: test_positive_size_loops_name_each_key) ----
    (["data.train_batch_size=0"], {}, "data.train_batch_size", "must be a positive integer, got 0"),
    (["data.val_batch_size=0"], {}, "data.val_batch_size", "must be null or a positive integer, got 0"),
    # -- layout --------------------------------------------------------------------------------
    ([], dict(world_size=4), "trainer.n_gpus_per_node",
     "trainer.nnodes x trainer.n_gpus_per_node = 1 x 2 = 2, but the launcher started WORLD_SIZE=4"),
    (["trainer.n_gpus_per_node=3", A + "megatron.tensor_model_parallel_size=2"], {},
     A + "megatron.tensor_model_parallel_size", "must be divisible by TP x PP = 2 x 1"),
    (["trainer.n_gpus_per_node=6", A + "megatron.tensor_model_parallel_size=2",
      A + "megatron.pipeline_model_parallel_size=2", "data.train_batch_size=12"], WS,
     A + "megatron.tensor_model_parallel_size",
     "world size 6 (trainer.nnodes x trainer.n_gpus_per_node) must be divisible by TP x PP = 2 x 2 = 4 "
     f"({A}megatron.tensor_model_parallel_size x {A}megatron.pipeline_model_parallel_size)"),
    ([A + "megatron.virtual_pipeline_model_parallel_size=2"], {},
     A + "megatron.virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size > 1 (is 1); set it to null"),
    # -- context parallelism -----------------------------------------------------------------------
    ([A + "megatron.context_parallel_size=0"], {}, A + "megatron.context_parallel_size", "must be >= 1, got 0"),
    (["trainer.n_gpus_per_node=6", A + "megatron.context_parallel_size=2", A + "megatron.pipeline_model_parallel_size=2",
      "data.train_batch_size=12"], WS, A + "megatron.context_parallel_size",
     "world size 6 (trainer.nnodes x trainer.n_gpus_per_node) must be divisible by TP x CP x PP = 1 x 2 x 2 = 4"),
    (["critic.megatron.context_parallel_size=2"], {}, "critic.megatron.context_parallel_size",
     f"must equal {A}megatron.context_parallel_size (1), got 2"),
    # -- split placement (actor_rollout_ref.hybrid_engine=False) ----------------------------------
    (["actor_rollout_ref.hybrid_engine=false", "rollout.n_gpus_per_node=2"], dict(world_size=2), "trainer.n_gpus_per_node",
     "trainer.nnodes x trainer.n_gpus_per_node = 1 x 2 + rollout.nnodes x rollout.n_gpus_per_node = 1 x 2 = 4, "
     "but the launcher started WORLD_SIZE=2"),
    (["actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=2", "rollout.n_gpus_per_node=4"], {},
     "rollout.n_gpus_per_node", "must equal trainer.n_gpus_per_node (2) when the rollout has nodes of its own"),
    (["trainer.async_mode=one_step_off"], {}, "trainer.async_mode", "one_step_off needs the split placement"),
    (["actor_rollout_ref.hybrid_engine=false", "rollout.n_gpus_per_node=3", R + "tensor_model_parallel_size=2"], {},
     R + "tensor_model_parallel_size", "must divide rollout.n_gpus_per_node (3): each vLLM replica's ranks stay inside"),
    (["actor_rollout_ref.hybrid_engine=false", "rollout.n_gpus_per_node=2", "trainer.async_mode=one_step_off",
      "algorithm.filter_groups.enable=true", "data.gen_batch_size=8"], {},
     "trainer.async_mode", "one_step_off does not combine with dynamic sampling"),
    # -- expert parallelism (Mixture-of-Experts) --------------------------------------------------
    ([A + "megatron.expert_model_parallel_size=0"], {}, A + "megatron.expert_model_parallel_size", "must be >= 1, got 0"),
    ([A + "megatron.expert_model_parallel_size=4", A + "megatron.pipeline_model_parallel_size=2",
      "trainer.n_gpus_per_node=4"], {}, A + "megatron.expert_model_parallel_size",
     "must divide world size / PP = 4 / 2 = 2 (the expert-parallel ranks are taken from each pipeline stage's"),
    (["critic.megatron.expert_tensor_parallel_size=2"], {}, "critic.megatron.expert_tensor_parallel_size",
     "must be 1 or null: megappo keeps each expert whole on its EP rank"),
    (["actor_rollout_ref.ref.megatron.expert_model_parallel_size=2"], {},
     "actor_rollout_ref.ref.megatron.expert_model_parallel_size", f"must equal {A}megatron.expert_model_parallel_size (1)"),
    (GOOD_PATHS + [A + "megatron.expert_model_parallel_size=2"], PATHS, A + "megatron.expert_model_parallel_size",
     "must be 1: actor_rollout_ref.model.path ({tmp}/model) is a dense model (no num_experts in its config.json), got 2"),
    (GOOD_PATHS + ["actor_rollout_ref.model.path={tmp}/moe3", A + "megatron.expert_model_parallel_size=2"], PATHS,
     A + "megatron.expert_model_parallel_size", "must divide the model's num_experts (3, actor_rollout_ref.model.path), got 2"),
    (["critic.megatron.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=4"], {},
     "critic.megatron.tensor_model_parallel_size",
     f"must equal {A}megatron.tensor_model_parallel_size (1), got 2: the actor, reference and critic share one "
     "megatron parallel state"),
    (["actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2", "trainer.n_gpus_per_node=4"], {},
     "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size", "must equal"),
    (["critic.megatron.virtual_pipeline_model_parallel_size=2"], {},
     "critic.megatron.virtual_pipeline_model_parallel_size", "must equal"),
    ([R + "tensor_model_parallel_size=4", "trainer.n_gpus_per_node=2"], {},
     R + "tensor_model_parallel_size", "world size 2 must be divisible by the rollout TP size 4"),
    # -- batch sizes -----------------------------------------------------------------------------
    (["data.train_batch_size=6"], {}, A + "ppo_mini_batch_size",
     f"data.train_batch_size (6) must be divisible by {A}ppo_mini_batch_size (4)"),
    (["critic.ppo_mini_batch_size=3"], {}, "critic.ppo_mini_batch_size",
     "data.train_batch_size (8) must be divisible by critic.ppo_mini_batch_size (3)"),
    (["trainer.n_gpus_per_node=3"], {}, A + "ppo_mini_batch_size",
     "4 prompts x rollout.n 2 = 8 samples must split evenly over 3 data-parallel ranks"),
    ([A + "ppo_micro_batch_size_per_gpu=3"], {}, A + "ppo_micro_batch_size_per_gpu",
     "the per-rank mini-batch (4 x 2 / DP 2 = 4 samples) must be divisible by the micro-batch size 3"),
    (["critic.ppo_micro_batch_size_per_gpu=3"], {}, "critic.ppo_micro_batch_size_per_gpu", "micro-batch size 3"),
    ([A + "ppo_micro_batch_size_per_gpu=null"], {}, A + "ppo_micro_batch_size_per_gpu",
     f"must be set when {A}use_dynamic_bsz is false"),
    (["critic.ppo_micro_batch_size_per_gpu=null"], {}, "critic.ppo_micro_batch_size_per_gpu",
     "must be set when critic.use_dynamic_bsz is false"),
    ([A + "use_dynamic_bsz=true", A + "ppo_max_token_len_per_gpu=50"], {}, A + "ppo_max_token_len_per_gpu",
     "token budget 50 is smaller than one sequence (data.max_prompt_length + data.max_response_length = 96)"),
    (["critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=50"], {}, "critic.ppo_max_token_len_per_gpu",
     "token budget 50 is smaller than one sequence"),
    (["critic.use_dynamic_bsz=true", "critic.forward_max_token_len_per_gpu=40"], {},
     "critic.forward_max_token_len_per_gpu", "token budget 40 is smaller than one sequence (96 tokens)"),
    (["trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=3"], {}, "trainer.max_critic_ckpt_to_keep",
     "must equal trainer.max_actor_ckpt_to_keep (2), got 3: megappo saves the actor and the critic together"),
    ([R + "log_prob_use_dynamic_bsz=true", R + "log_prob_max_token_len_per_gpu=50"], {},
     R + "log_prob_max_token_len_per_gpu", "token budget 50 is smaller than one sequence (96 tokens)"),
    (["actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=9"],
     {}, "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu", "token budget 9"),
    ([R + "log_prob_micro_batch_size_per_gpu=null"], {}, R + "log_prob_micro_batch_size_per_gpu",
     f"must be set when {R}log_prob_use_dynamic_bsz is false"),
    (["actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=null"], {},
     "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
     "must be set when actor_rollout_ref.ref.log_prob_use_dynamic_bsz is false"),
    # (reachable alone only when the mini-batch rules are skipped, here by a mini-batch of 0)
    ([A + "ppo_mini_batch_size=0", "trainer.n_gpus_per_node=3", "data.train_batch_size=4"], {},
     "data.train_batch_size", "train_batch_size x rollout.n = 8 samples must split evenly over 3 data-parallel ranks"),
    # -- PPO / KL --------------------------------------------------------------------------------
    ([A + "clip_ratio_c=0.5"], {}, A + "clip_ratio_c", "dual-clip constant must be > 1, got 0.5"),
    ([A + "clip_ratio_c=1.0"], {}, A + "clip_ratio_c", "must be > 1"),
    ([A + "clip_ratio=-0.1"], {}, A + "clip_ratio", "must be >= 0, got -0.1"),
    ([A + "clip_ratio_low=-0.1"], {}, A + "clip_ratio_low", "must be >= 0, got -0.1"),
    ([A + "clip_ratio_high=-1"], {}, A + "clip_ratio_high", "must be >= 0, got -1.0"),
    (["critic.cliprange_value=0"], {}, "critic.cliprange_value", "must be > 0, got 0.0"),
    (["critic.replay_batches=-1"], {}, "critic.replay_batches", "must be an integer >= 0, got -1"),
    ([A + "entropy_coeff=-0.01"], {}, A + "entropy_coeff", "must be >= 0, got -0.01"),
    ([A + "kl_loss_coef=-1"], {}, A + "kl_loss_coef", "must be >= 0, got -1.0"),
    (["algorithm.kl_ctrl.kl_coef=-1"], {}, "algorithm.kl_ctrl.kl_coef", "must be >= 0, got -1.0"),
    (["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0"], {}, "algorithm.kl_ctrl.target_kl",
     "the adaptive controller needs target_kl > 0, got 0.0"),
    (["algorithm.gamma=-0.5"], {}, "algorithm.gamma", "must be in [0, 1], got -0.5"),
    (["algorithm.lam=1.5"], {}, "algorithm.lam", "must be in [0, 1], got 1.5"),
    (["algorithm.critic_lam=-0.1"], {}, "algorithm.critic_lam", "must be in [0, 1], got -0.1"),
    (["algorithm.lam_length_alpha=0"], {}, "algorithm.lam_length_alpha", "must be > 0 (VAPO uses 0.05), got 0.0"),
    (["algorithm.gae_adv_norm=token"], {}, "algorithm.gae_adv_norm", "must be auto, batch, group, group_shift, group_centred or group_cv, got 'token'"),
    (["algorithm.gae_cv_decay=1.0"], {}, "algorithm.gae_cv_decay", "must be in [0, 1), got 1.0"),
    (["algorithm.gae_cv_beta_max=0"], {}, "algorithm.gae_cv_beta_max", "must be > 0, got 0.0"),
    (["algorithm.gae_cv_min_t=0.5"], {}, "algorithm.gae_cv_min_t", "must be >= 1, got 0.5"),
    (["algorithm.critic_target=mean"], {}, "algorithm.critic_target", "must be return or group_relative, got 'mean'"),
    (["algorithm.critic_target=group_relative", "algorithm.gae_adv_norm=group"], {}, "algorithm.critic_target",
     "only gae_adv_norm group_shift, group_centred or group_cv (n > 1) read correctly; this run has gae_adv_norm='group'"),
    (["algorithm.gae_adv_norm=group", "actor_rollout_ref.rollout.n=1"], {}, "algorithm.gae_adv_norm",
     "needs actor_rollout_ref.rollout.n > 1, got 1"),
    (["algorithm.gae_adv_norm=group_shift", "algorithm.lam_length_alpha=0.05"], {}, "algorithm.gae_adv_norm",
     "group_shift takes one lambda (algorithm.lam): unset algorithm.lam_length_alpha"),
    ([A + "kl_loss_type=k4"], {}, A + "kl_loss_type", "unknown KL estimator 'k4'; supported: kl, k1"),
    ([A + "policy_loss.loss_mode=ppo2"], {}, A + "policy_loss.loss_mode",
     "unknown policy loss 'ppo2'; registered: cispo, clip_cov, dppo_kl"),
    ([A + "tau_pos=0"], {}, A + "tau_pos", "SAPO's gate temperature must be > 0, got 0.0"),
    ([A + "policy_loss.clip_cov_ratio=0"], {}, A + "policy_loss.clip_cov_ratio", "must be > 0, got 0.0"),
    ([A + "policy_loss.kl_cov_ratio=-1"], {}, A + "policy_loss.kl_cov_ratio", "must be > 0, got -1.0"),
    ([A + "policy_loss.ppo_kl_coef=0"], {}, A + "policy_loss.ppo_kl_coef", "must be > 0, got 0.0"),
    ([A + "policy_loss.clip_cov_ub=0.5"], {}, A + "policy_loss.clip_cov_ub", "must be above clip_cov_lb (1.0), got 0.5"),
    ([A + "policy_loss.loss_mode=dro"], {}, A + "policy_loss.dro_beta", "loss_mode=dro needs a penalty weight > 0, got None"),
    ([A + "policy_loss.loss_mode=dro", A + "policy_loss.dro_beta=0"], {}, A + "policy_loss.dro_beta",
     "loss_mode=dro needs a penalty weight > 0, got 0.0"),
    (["algorithm.rollout_correction.rollout_is_threshold=0"], {}, "algorithm.rollout_correction.rollout_is_threshold",
     "must be > 0, got 0.0"),
    # rejection sampling: the option list, then its bounds (one need site, the key at fault)
    ([RC + "rollout_rs=token_k4", RC + "rollout_rs_threshold=2"], {}, RC + "rollout_rs",
     "unknown option 'token_k4'; supported: token_k1, token_k2, token_k3, seq_sum_k1"),
    ([RC + "rollout_rs=seq_mean_k3"], {}, RC + "rollout_rs_threshold", "is required with rollout_rs=seq_mean_k3"),
    ([RC + "rollout_rs=token_k1,seq_max_k2", RC + "rollout_rs_threshold=0.5_2.0,0.1_1"], {}, RC + "rollout_rs_threshold",
     "entry '0.1_1' for seq_max_k2: a k2/k3 option takes one upper bound"),
    ([RC + "rollout_rs=seq_sum_k1", RC + "rollout_rs_threshold=0.5"], {}, RC + "rollout_rs_threshold",
     "lower bound 2 above upper bound 0.5 keeps nothing"),
    ([RC + "rollout_rs=token_k2,token_k3", RC + "rollout_rs_threshold=0.1,0.2,0.3"], {}, RC + "rollout_rs_threshold",
     "has 3 entries for 2 options (token_k2, token_k3)"),
    # bypass mode's REINFORCE loss
    ([RC + "bypass_mode=true", RC + "loss_type=reinforce", A + "policy_loss.loss_mode=gspo"], {},
     A + "policy_loss.loss_mode", "loss_type=reinforce with bypass_mode=true is the policy loss (as verl)"),
    ([RC + "bypass_mode=true", RC + "loss_type=reinforce", RC + "rollout_is=token", RC + "rollout_is_batch_normalize=true"],
     {}, RC + "rollout_is_batch_normalize", "is not supported with loss_type=reinforce"),
    (["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=100000"], {},
     "reward_model.overlong_buffer.len", "must be in (0, data.max_response_length="),
    (["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.max_resp_len=0"], {},
     "reward_model.overlong_buffer.max_resp_len", "must be >= 1 (null: data.max_response_length), got 0"),
    (["reward_model.overlong_buffer.enable=true", "reward_model.reward_kwargs.max_resp_len=64",
      "+reward_model.reward_kwargs.overlong_buffer_cfg.len=100"], {},
     "reward_model.overlong_buffer.len", "must be in (0, reward_model.overlong_buffer.max_resp_len=64], got 100"),
    (["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=8",
      "reward_model.overlong_buffer.penalty_factor=-1"], {}, "reward_model.overlong_buffer.penalty_factor",
     "must be >= 0, got -1.0"),
    (["algorithm.kl_penalty=full+"], {}, "algorithm.kl_penalty", "unknown KL estimator 'full+'; supported: kl, k1"),
    (["algorithm.adv_estimator=ppo2"], {}, "algorithm.adv_estimator",
     "unknown advantage estimator 'ppo2'; registered: gae, gdpo, gpg, grpo"),
    (["critic.enable=false"], {}, "critic.enable", "algorithm.adv_estimator=gae needs a critic (values)"),
    (["algorithm.adv_estimator=optimal_token_baseline", R + "n=4", "algorithm.rollout_correction.bypass_mode=true"], {},
     "algorithm.rollout_correction.bypass_mode", "needs sum pi^2 from the old-log-prob pass, which bypass mode skips"),
    (["algorithm.adv_estimator=gdpo", R + "n=4"], {}, "algorithm.gdpo_reward_keys",
     "needs the reward components to normalise"),
    (["algorithm.adv_estimator=gdpo", R + "n=4", "algorithm.gdpo_reward_keys=[a,b]", "algorithm.gdpo_reward_weights=[1.0]"],
     {}, "algorithm.gdpo_reward_weights", "needs one weight per gdpo_reward_keys entry (2), got 1"),
    (["algorithm.adv_estimator=gdpo", R + "n=4", "algorithm.gdpo_reward_keys=[a]", "reward_model.enable=true"], {},
     "reward_model.enable", "a reward model gives one score"),
    (["algorithm.adv_estimator=grpo", R + "n=1"], {}, R + "n", "needs rollout.n > 1 (got 1)"),
    (["algorithm.adv_estimator=rloo", R + "n=1"], {}, R + "n", "n > 1"),
    # -- sampling --------------------------------------------------------------------------------
    (["algorithm.filter_groups.enable=true"], {}, "algorithm.filter_groups.metric",
     "dynamic sampling needs the metric that must vary within a group: acc, score, seq_reward or seq_final_reward"),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=seq_final_reward",
      "algorithm.use_kl_in_reward=true"], {}, "algorithm.filter_groups.metric",
     "seq_final_reward with algorithm.use_kl_in_reward=true would need the old and reference log-probs"),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc", "reward_model.enable=true"], {},
     "algorithm.filter_groups.metric", "a reward model gives scores only: use score or seq_reward"),
    (["data.gen_batch_size=16"], {}, "data.gen_batch_size", "set algorithm.filter_groups.enable=true or leave it null"),
    ([R + "temperature=-1"], {}, R + "temperature", "must be >= 0, got -1.0"),
    ([R + "val_kwargs.temperature=-1"], {}, R + "val_kwargs.temperature", "must be >= 0"),
    ([R + "top_p=0"], {}, R + "top_p", "must be in (0, 1], got 0.0"),
    ([R + "val_kwargs.top_p=1.5"], {}, R + "val_kwargs.top_p", "must be in (0, 1], got 1.5"),
    ([R + "top_k=0"], {}, R + "top_k", "must be -1 (disabled) or >= 1, got 0"),
    ([R + "val_kwargs.top_k=-2"], {}, R + "val_kwargs.top_k", "must be -1 (disabled) or >= 1, got -2"),
    ([R + "gpu_memory_utilization=1.5"], {}, R + "gpu_memory_utilization", "must be in (0, 1], got 1.5"),
    ([R + "max_num_batched_tokens=50"], {}, R + "max_num_batched_tokens", "50 is smaller than one sequence (96 tokens)"),
    ([R + "engine_kwargs.vllm.enforce_eager=true"], {}, R + "engine_kwargs.vllm.enforce_eager",
     "megappo sets it (actor_rollout_ref.rollout.enforce_eager)"),
    ([R + "max_model_len=95"], {}, R + "engine_kwargs.vllm.max_model_len",       # verl's key lands there
     "an integer >= data.max_prompt_length + data.max_response_length = 96, got 95"),
    ([R + "multi_turn.interaction_config_path={tmp}/reward.py"], PATHS, R + "multi_turn.enable",
     "must be true with multi_turn.interaction_config_path"),
    ([R + "multi_turn.enable=true", R + "multi_turn.interaction_config_path={tmp}/reward.py"], PATHS,
     R + "multi_turn.interaction_config_path", "expected a mapping with a non-empty 'interaction' list"),
    (["reward_model.reward_manager=prime", "reward_model.enable=true", "reward_model.model.path=x"], {},
     "reward_model.reward_manager", "prime runs the rule or custom reward function in worker processes"),
    (["reward_model.reward_manager=prime", "reward_model.prime_timeout_s=0"], {}, "reward_model.prime_timeout_s",
     "must be > 0 seconds, got 0.0"),
    (["reward_model.reward_manager=prime", "reward_model.prime_workers=0"], {}, "reward_model.prime_workers",
     "must be null or a positive number of processes, got 0"),
    (["reward_model.reward_manager=batch"], {}, "reward_model.reward_manager",
     "batch calls custom_reward_function.path's function with lists"),
    ([A + "checkpoint.save_contents=[model,extra]"], {}, A + "checkpoint.save_contents",
     "must hold model, optimizer and extra (a resumable checkpoint; add hf_model to write a HuggingFace folder too) "
     "or be [hf_model] (HuggingFace exports only); got ['model', 'extra'] (to save nothing, set trainer.save_freq=-1)"),
    ([A + "checkpoint.load_contents=[model]"], {}, A + "checkpoint.load_contents",
     "must hold model, optimizer and extra: a resume restores all three; got ['model'] (to start from a checkpoint's "
     "weights with a fresh optimizer, set actor_rollout_ref.actor.megatron.use_dist_checkpointing=True"),
    ([A + "checkpoint.save_contents=[hf_model]"], {}, "critic.checkpoint.save_contents",   # (tiny_cpu: gae, a critic)
     "must be resumable (model, optimizer, extra) exactly when the actor's is"),
    (["trainer.val_only=true", "data.val_files=[]"], {}, "data.val_files",
     "must name validation files when trainer.val_only=true"),
    (["data.train_max_samples=0"], {}, "data.train_max_samples", "must be -1 (every row) or a positive number of rows, got 0"),
    (["data.val_max_samples=-2"], {}, "data.val_max_samples", "must be -1 (every row) or a positive number of rows, got -2"),
    # -- optimizers ------------------------------------------------------------------------------
    ([A + "optim.lr=-1e-6"], {}, A + "optim.lr", "must be >= 0, got -1e-06"),
    (["critic.optim.lr=-1"], {}, "critic.optim.lr", "must be >= 0"),
    (["critic.optim.clip_grad=-1"], {}, "critic.optim.clip_grad", "must be >= 0 (0 disables), got -1.0"),
    ([A + "optim.lr_warmup_steps_ratio=1.5"], {}, A + "optim.lr_warmup_steps_ratio", "must be in [0, 1], got 1.5"),
    ([A + "optim.lr_warmup_steps=-2"], {}, A + "optim.lr_warmup_steps", "must be -1 or >= 0, got -2"),
    ([A + "optim.betas=[0.9]"], {}, A + "optim.betas", "must be two numbers in [0, 1), got [0.9]"),
    (["critic.optim.betas=[0.9, 1.0]"], {}, "critic.optim.betas", "must be two numbers in [0, 1)"),
    # -- trainer ---------------------------------------------------------------------------------
    (["trainer.save_freq=0"], {}, "trainer.save_freq", "must be -1 (disabled) or a positive number of steps, got 0"),
    (["trainer.test_freq=-5"], {}, "trainer.test_freq", "-1 (disabled)"),
    (["trainer.critic_warmup=-1"], {}, "trainer.critic_warmup", "must be >= 0, got -1"),
    (["trainer.dist_timeout_s=0"], {}, "trainer.dist_timeout_s", "must be >= 1 second, got 0"),
    (["trainer.log_val_generations=-1"], {}, "trainer.log_val_generations",
     "must be >= 0 (validation samples to log; 0: none), got -1"),
    (["trainer.watchdog_silence_s=-1"], {}, "trainer.watchdog_silence_s", "must be >= 0 (0 disables), got -1"),
    (["trainer.watchdog_slow_phase_s=-1"], {}, "trainer.watchdog_slow_phase_s", "must be >= 0, got -1"),
    (["trainer.resume_mode=resume_path"], {}, "trainer.resume_from_path", "must be set when trainer.resume_mode=resume_path"),
    (["trainer.resume_mode=''"], {}, "trainer.resume_mode", "must be disable, auto, resume_path or a checkpoint path, got ''"),
    (["data.train_files=[]"], {}, "data.train_files", "needs at least one file"),
    (["reward_model.enable=true"], {}, "reward_model.model.path", "must be set when reward_model.enable=True"),
    (["reward_model.enable=true", "reward_model.model.path=rm", "reward_model.micro_batch_size_per_gpu=null"], {},
     "reward_model.micro_batch_size_per_gpu", "must be set unless reward_model.use_dynamic_bsz"),
    (["data.max_response_length=10000000"], {}, "data.max_response_length",
     "data.max_prompt_length + data.max_response_length = 10000064 tokens is implausibly long; expected fewer than 10000000"),
    ([A + "megatron.use_dist_checkpointing=true"], {}, A + "megatron.dist_checkpointing_path",
     "must be set when actor_rollout_ref.actor.megatron.use_dist_checkpointing=True"),
    # -- paths, on a real start only -------------------------------------------------------------
    (GOOD_PATHS + ["critic.megatron.use_dist_checkpointing=true", "critic.megatron.dist_checkpointing_path={tmp}/nockpt"],
     PATHS, "critic.megatron.dist_checkpointing_path", "checkpoint directory not found: {tmp}/nockpt"),
    (GOOD_PATHS + [A + "megatron.use_dist_checkpointing=true", A + "megatron.dist_checkpointing_path={tmp}/ckpt"],
     PATHS, A + "megatron.dist_checkpointing_path", "{tmp}/ckpt is not a megatron-core dist_checkpointing folder "
     "(no metadata.json; expected what megatron's dist_checkpointing.save or verl's converter_hf_to_mcore.py writes)"),
    # -- LoRA: verl's keys checked (names against the HF modules megappo adapts); what it does not run with yet
    (["actor_rollout_ref.model.lora_rank=-1"], {}, "actor_rollout_ref.model.lora_rank", "must be >= 0 (0 turns LoRA off), got -1"),
    (["critic.model.lora_rank=-2"], {}, "critic.model.lora_rank", "must be >= 0 (0 turns LoRA off), got -2"),
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.target_modules=q_proj,qproj"], {},
     "actor_rollout_ref.model.target_modules",
     "unknown module name 'qproj'; accepted: all-linear, q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
    (["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.exclude_modules=[lm_head, o_proj]"], {},
     "actor_rollout_ref.model.exclude_modules", "unknown module name 'lm_head'; accepted: all-linear, q_proj"),
    (["critic.model.lora_rank=4", "critic.model.target_modules=[linear_qkv, router]"], {}, "critic.model.target_modules",
     "unknown module names 'linear_qkv', 'router'; accepted: all-linear,"),
    (GOOD_PATHS + ["actor_rollout_ref.model.lora_adapter_path={tmp}/model"], PATHS, "actor_rollout_ref.model.lora_adapter_path",
     "{tmp}/model: no adapter_config.json (expected a PEFT LoRA adapter folder)"),
    (GOOD_PATHS + ["actor_rollout_ref.model.path={tmp}/moe3", "actor_rollout_ref.model.lora_rank=8"], PATHS,
     "actor_rollout_ref.model.target_modules", "must name attention modules only (q_proj, k_proj, v_proj, o_proj) on "
     "actor_rollout_ref.model.path, a Mixture-of-Experts model (3 experts): megappo does not build adapters for its "
     "experts and router; got gate_proj, up_proj, down_proj among the modules"),
    # -- multi-turn (the tool files are checked without importing them)
    ([R + "multi_turn.enable=true", "data.return_raw_chat=false"], {}, "data.return_raw_chat",
     "must be true with multi_turn.enable"),
    ([R + "multi_turn.tool_config_path={tmp}/nope.yaml"], {}, R + "multi_turn.tool_config_path",
     "file not found: {tmp}/nope.yaml"),
    ([R + "multi_turn.tool_config_path={tmp}/tools_bad.yaml"], {}, R + "multi_turn.tool_config_path",
     "{tmp}/tools_bad.yaml: tools[0].class_name: expected a dotted path pkg.module.Class, got 'Calc'"),
    ([R + "multi_turn.function_tool_path={tmp}/reward.py.txt"], {}, R + "multi_turn.function_tool_path",
     "file not found: {tmp}/reward.py.txt"),
    ([R + "multi_turn.function_tool_path={tmp}/tools_bad.yaml"], {}, R + "multi_turn.function_tool_path",
     "expected a Python file (.py), got {tmp}/tools_bad.yaml"),
    (GOOD_PATHS + ["data.val_files={tmp}/nope.parquet"], PATHS, "data.val_files", "file not found: {tmp}/nope.parquet"),
    (GOOD_PATHS + ["actor_rollout_ref.model.path={tmp}/nomodel"], PATHS, "actor_rollout_ref.model.path",
     "model directory not found: {tmp}/nomodel"),
    (GOOD_PATHS + ["actor_rollout_ref.model.path={tmp}/ckpt"], PATHS, "actor_rollout_ref.model.path",
     "{tmp}/ckpt has no config.json (expected a HuggingFace model folder)"),
    # -- an uneven pipeline split (megatron's keys under override_transformer_config)
    ([A + "megatron.override_transformer_config.num_layers_in_last_pipeline_stage=0"], {},
     A + "megatron.override_transformer_config.num_layers_in_last_pipeline_stage",
     "must be at least 1 (or null: an even split), got 0"),
    (["critic.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=2",
      "critic.megatron.override_transformer_config.account_for_loss_in_pipeline_split=true"], {},
     "critic.megatron.override_transformer_config.account_for_embedding_in_pipeline_split",
     "the embedding and loss cannot be counted as layers when num_layers_in_first/last_pipeline_stage set"),
    # -- override_config.model_config: shapes kept, what transformers reads, a context vLLM takes
    (["actor_rollout_ref.model.override_config.model_config.num_hidden_layers=2"], {},
     "actor_rollout_ref.model.override_config.model_config", "num_hidden_layers: changes the shapes of the model's weights"),
    (GOOD_PATHS + ["actor_rollout_ref.model.path={tmp}/qwen", "critic.model.override_config.model_config.rope_scaling="
                   "{{rope_type: yarn, factor: 4.0, original_max_position_embeddings: 4096}}"], PATHS,
     "critic.model.override_config.model_config", "RoPE type 'yarn' is not supported; supported: default, linear, llama3"),
    (GOOD_PATHS + ["actor_rollout_ref.model.path={tmp}/qwen", "data.max_response_length=1000",
                   "actor_rollout_ref.model.override_config.model_config.max_position_embeddings=1000"], PATHS,
     "actor_rollout_ref.model.override_config.model_config.max_position_embeddings",
     "the model's max_position_embeddings (1000) is shorter than the rollout's context (data.max_prompt_length + "
     "data.max_response_length, or engine_kwargs.vllm.max_model_len: 1064): vLLM refuses that context without RoPE "
     "scaling (or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1); raise it or shorten"),
    (GOOD_PATHS + ["actor_rollout_ref.model.path={tmp}/qwen", "data.max_response_length=600"], PATHS,
     "actor_rollout_ref.model.path", "max_position_embeddings (512) is shorter than the rollout's context "
     "(data.max_prompt_length + data.max_response_length, or engine_kwargs.vllm.max_model_len: 664): vLLM refuses "
     "that context without RoPE scaling (or VLLM_ALLOW_LONG_MAX_MODEL_LEN=1); set "
     "actor_rollout_ref.model.override_config.model_config.max_position_embeddings"),
    (GOOD_PATHS + ["custom_reward_function.path={tmp}/nope.py"], PATHS, "custom_reward_function.path",
     "file not found: {tmp}/nope.py"),
    (GOOD_PATHS + ["trainer.logger=[console,mlflow]"], dict(PATHS, installed=lambda name: name != "mlflow"),
     "trainer.logger", "mlflow is not installed: pip install mlflow (or megappo[loggers]), or drop it from the list"),
    (GOOD_PATHS + ["trainer.resume_mode=resume_path", "trainer.resume_from_path={tmp}/nockpt"], PATHS,
     "trainer.resume_from_path", "checkpoint directory not found: {tmp}/nockpt"),
    (GOOD_PATHS + ["trainer.resume_mode={tmp}/nockpt"], PATHS, "trainer.resume_mode",
     "expected disable, auto, resume_path or an existing checkpoint directory, got '{tmp}/nockpt'"),
]


QWEN = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
        "max_position_embeddings": 512, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.fixture(scope="module")
def path_tree(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("paths")
    for name in ("train.parquet", "test.parquet", "reward.py"):
        (tmp / name).write_bytes(b"x")
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text("{}")
    (tmp / "moe3").mkdir()   # a Mixture-of-Experts model whose 3 experts EP2 cannot divide
    (tmp / "moe3" / "config.json").write_text('{"num_experts": 3}')
    (tmp / "qwen").mkdir()   # a model transformers reads: 512 positions
    (tmp / "qwen" / "config.json").write_text(json.dumps(QWEN))
    (tmp / "ckpt").mkdir()
    (tmp / "tools_bad.yaml").write_text("tools:\n  - class_name: Calc\n")
    return str(tmp)


def run_rule(row, tmp):
    overrides, kw, key, fragment = row
    overrides = [o.format(tmp=tmp) for o in overrides]
    err = fails(overrides, **kw)
    return err, key, fragment.format(tmp=tmp)


@pytest.mark.parametrize("row", RULES, ids=[f"{r[2]}:{r[3][:30]}" for r in RULES])
def test_each_rule_names_its_key(row, path_tree):
    err, key, fragment = run_rule(row, path_tree)
    assert key in keys_of(err), err
    msg = dict(err.errors)[key]
    assert fragment in msg, msg
    assert f"  - {key}: {msg}" in str(err)          # what the user sees names the key


def test_good_paths_pass_on_a_real_start(path_tree):
    ok([o.format(tmp=path_tree) for o in GOOD_PATHS], check_paths=True)


def test_lora_on_moe_takes_attention_modules(path_tree):
    """On a Mixture-of-Experts model LoRA adapts the attention: accepted for actor and critic when
    target_modules names attention modules only; an MLP module in the critic's list is named."""
    good = [o.format(tmp=path_tree) for o in GOOD_PATHS] + [f"actor_rollout_ref.model.path={path_tree}/moe3",
                                                             "actor_rollout_ref.model.lora_rank=8", "critic.model.lora_rank=4"]
    ok(good + ["actor_rollout_ref.model.target_modules=[q_proj, k_proj, v_proj, o_proj]",
               "critic.model.target_modules=all-linear", "actor_rollout_ref.model.exclude_modules=[]",
               "critic.model.target_modules=q_proj,v_proj"], check_paths=True)
    err = fails(good + ["actor_rollout_ref.model.target_modules=all-linear",
                        "actor_rollout_ref.model.exclude_modules=[gate_proj, up_proj, down_proj]",
                        "critic.model.target_modules=[o_proj, up_proj]"], check_paths=True)
    assert keys_of(err) == ["critic.model.target_modules"] and "got up_proj among the modules" in str(err), err


def _validate_source():
    import ast
    import inspect
    import textwrap

    from megappo.config import validation

    out = []
    for fn in validation.RULE_FUNCTIONS:
        lines, first = inspect.getsourcelines(fn)
        out.append((fn, "".join(lines), first, ast.parse(textwrap.dedent("".join(lines)))))
    return out


def _need_sites():
    """(function, first line, last line) of every need(...) call in the rule functions."""
    import ast

    sites = []
    for fn, text, first, tree in _validate_source():
        calls = [n for n in ast.walk(tree)
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "need"]
        # Sanity check of the scan: as many calls as the text spells 'need(' (less the definition).
        assert len(calls) == len(re.findall(r"\bneed\(", text)), fn
        sites += [(fn.__name__, n.lineno + first - 1, n.end_lineno + first - 1) for n in calls]
    return sorted(sites)


def _failing_need_calls(run):
    """{(function, line, key)} of the need(...) calls whose condition failed while run() ran."""
    from megappo.config import validation

    codes = {fn.__code__: fn.__name__ for fn in validation.RULE_FUNCTIONS}
    hits = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "need":
            caller = frame.f_back
            if caller is not None and caller.f_code in codes and not frame.f_locals.get("cond"):
                hits.add((codes[caller.f_code], caller.f_lineno, frame.f_locals.get("key")))

    old = sys.getprofile()
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(old)
    return hits


def test_every_need_site_has_a_row(path_tree):
    """Meta-check: every need(...) call in validate()'s rule functions is made to fail by at
    least one RULES row, so a rule added later without a row fails this test. It checks call
    sites, not every key of a rule that loops over keys (the positive-size loops are covered key by
    key below; the other loops' keys are listed in RULES by hand)."""
    hits = set()
    for row in RULES:
        hits |= _failing_need_calls(lambda: run_rule(row, path_tree))
    sites = _need_sites()
    assert len(sites) >= 50
    missing = [(fn, a) for fn, a, b in sites if not any(h[0] == fn and a <= h[1] <= b for h in hits)]
    src = {fn.__name__: (text.splitlines(), first) for fn, text, first, _ in _validate_source()}
    assert not missing, "need(...) calls no RULES row triggers:\n" + "\n".join(
        f"  {fn}:{line}: {src[fn][0][line - src[fn][1]].strip()}" for fn, line in missing)


def _loop_keys(marker: str) -> list[str]:
    """The keys of the `for key in (...)` loop in a rule function whose body's message contains ``marker``."""
    import ast

    for node in (n for _, _, _, tree in _validate_source() for n in ast.walk(tree)):
        if (isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple)
                and any(isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value.startswith(marker)
                        for c in ast.walk(ast.Module(body=node.body, type_ignores=[])))):
            return [eval(compile(ast.Expression(e), "<key>", "eval"), {"A": A, "R": R}) for e in node.iter.elts]
    raise AssertionError(f"no loop with {marker!r}")


POSITIVE = _loop_keys("must be a positive integer")
POSITIVE_OR_NULL = _loop_keys("must be null or a positive integer")


def test_positive_size_loops_found():
    assert "data.train_batch_size" in POSITIVE and "algorithm.kl_ctrl.horizon" in POSITIVE and len(POSITIVE) >= 19
    assert "data.val_batch_size" in POSITIVE_OR_NULL and len(POSITIVE_OR_NULL) >= 10
    assert set(POSITIVE) <= set(C.all_keys()) and set(POSITIVE_OR_NULL) <= set(C.all_keys())


@pytest.mark.parametrize("key", POSITIVE + POSITIVE_OR_NULL)
@pytest.mark.parametrize("value", ["0", "-3"])
def test_positive_size_loops_name_each_key(key, value):
    err = fails([f"{key}={value}"])
    assert key in keys_of(err), err
    want = "must be a positive integer" if key in POSITIVE else "must be null or a positive integer"
    assert dict(err.errors)[key] == f"{want}, got {value}"


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
    warnings = []
    ok(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "critic.replay_batches=2"], warnings=warnings)
    assert warnings == ["critic.replay_batches=2 is read only with a critic, and algorithm.adv_estimator=grpo builds none"]


def test_rollout_correction_settings_pass_and_warn_where_verl_ignores_them():
    """verl's rollout_rs / rollout_rs_threshold / loss_type presets pass; a threshold without
    rollout_rs, loss_type=reinforce without bypass mode and rollout_is with bypass PPO-clip are
    read by nothing (verl ignores them too): one warning each."""
    for rs, th in (("token_k1", "0.5_2.0"), ("seq_mean_k1", "0.999_1.001"), ("seq_mean_k3", "0.01"),
                   ("seq_sum_k1", "2"), ("token_k1,seq_max_k2", "0.6_1.4,0.05"), ("token_k2,seq_sum_k3", "0.1")):
        warnings = []
        ok([RC + f"rollout_rs={rs}", RC + f"rollout_rs_threshold={th}"], warnings=warnings)
        assert not warnings, (rs, th, warnings)
    warnings = []   # verl's bypass_pg_geo_rs preset, and bypass_pg_is
    ok([RC + "bypass_mode=true", RC + "loss_type=reinforce", RC + "rollout_rs=seq_mean_k1",
        RC + "rollout_rs_threshold=0.999_1.001"], warnings=warnings)
    ok([RC + "bypass_mode=true", RC + "loss_type=reinforce", RC + "rollout_is=sequence",
        A + "policy_loss.loss_mode=reinforce"], warnings=warnings)
    assert not warnings, warnings
    for overrides, says in (([RC + "rollout_rs_threshold=0.01"], RC + "rollout_rs_threshold has no effect without rollout_rs"),
                            ([RC + "loss_type=reinforce"], RC + "loss_type=reinforce has no effect without bypass_mode=true"),
                            ([RC + "bypass_mode=true", RC + "rollout_is=token"], RC + "rollout_is has no effect")):
        warnings = []
        ok(overrides, warnings=warnings)
        assert len(warnings) == 1 and warnings[0].startswith(says), warnings
    err = fails([RC + "loss_type=pg"])
    assert "expected one of 'ppo_clip', 'reinforce'" in dict(err.errors)[RC + "loss_type"]


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


def test_paths_checked_only_on_a_real_start(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the preset's relative paths must not exist (the main job creates them)
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
    from megappo.layout import parallel_layout

    lay = parallel_layout(cfg)
    assert lay.tp * lay.pp * lay.dp == world


def test_custom_reward_function_path_checked_on_real_start(tmp_path):
    err = fails([f"custom_reward_function.path={tmp_path}/nope.py"], check_paths=True)
    assert "file not found" in dict(err.errors)["custom_reward_function.path"]
    ok([f"custom_reward_function.path={tmp_path}/nope.py"])  # the dry run does not look


def test_verl_reward_model_forward_micro_batch_and_torch_compile():
    """verl's reward_model.forward_micro_batch_size_per_gpu sets the reward model's forward
    micro-batch; use_torch_compile is accepted, with a warning saying it does nothing here."""
    from megappo.config import load_config

    warnings = []
    cfg = load_config(["reward_model.forward_micro_batch_size_per_gpu=3", "actor_rollout_ref.actor.use_torch_compile=True",
                       "actor_rollout_ref.ref.use_torch_compile=False"], ["tiny_cpu"], warnings=warnings)
    assert cfg.reward_model.micro_batch_size_per_gpu == 3
    assert [w for w in warnings if "use_torch_compile" in w] == [
        w for w in warnings if w.startswith("actor_rollout_ref.actor.use_torch_compile=True has no effect")]
    assert len([w for w in warnings if "use_torch_compile" in w]) == 1
    cfg = load_config([], ["tiny_cpu"])
    assert cfg.reward_model.micro_batch_size_per_gpu == cfg.critic.forward_micro_batch_size_per_gpu


def test_verl_compat_says_what_each_override_becomes(tmp_path):
    import subprocess

    from megappo.config.parse import verl_compat

    assert verl_compat("data.train_batch_size=64")[0] == "set"
    assert verl_compat("reward_model.forward_micro_batch_size_per_gpu=4") == (
        "mapped", "reward_model.forward_micro_batch_size_per_gpu", "sets reward_model.micro_batch_size_per_gpu")
    assert verl_compat("actor_rollout_ref.actor.use_torch_compile=False")[0] == "accepted"
    assert verl_compat("actor_rollout_ref.actor.use_torch_compile=True")[0] == "warned"
    assert verl_compat("actor_rollout_ref.actor.megatron.context_parallel_size=2")[0] == "set"
    assert verl_compat("trainer.default_hdfs_dir=hdfs://x")[:2] == ("refused", "trainer.default_hdfs_dir")
    status, key, why = verl_compat("reward_model.megatron.context_parallel_size=2")
    assert (status, key) == ("refused", "reward_model.megatron.context_parallel_size") and "critic's layout" in why
    assert verl_compat("data.train_batch_size=abc") == ("refused", "data.train_batch_size", "expected an integer, got 'abc'")
    assert verl_compat("trainer.nobody=1")[0] == "unknown"
    cmd = tmp_path / "run_verl.sh"
    cmd.write_text("# comment\npython3 -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer \\\n"
                   "    data.train_batch_size=64 \\\n    +actor_rollout_ref.actor.use_torch_compile=True $@\n")
    p = subprocess.run([sys.executable, "-m", "megappo.config", "--verl-compat", str(cmd)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[:2] == ["set       data.train_batch_size: a megappo key",
                                         p.stdout.splitlines()[1]] and p.stdout.splitlines()[1].startswith("warned ")
    assert p.stdout.splitlines()[-1] == "2 overrides: 0 refused or unknown"
    cmd.write_text("trainer.nobody=1\n")
    p = subprocess.run([sys.executable, "-m", "megappo.config", "--verl-compat", str(cmd)], capture_output=True, text=True)
    assert p.returncode == 1 and p.stdout.startswith("unknown   trainer.nobody")


def test_start_checkpoint_warnings():
    """A dist_checkpointing_path without use_dist_checkpointing is ignored, and an actor that
    starts from a checkpoint beside a reference that does not: both said, neither an error."""
    m = "actor_rollout_ref.actor.megatron."
    warnings = []
    ok([m + "dist_checkpointing_path=/ckpt"], warnings=warnings)
    assert warnings == [f"{m}dist_checkpointing_path is set but {m}use_dist_checkpointing is False: the weights "
                        f"come from the HF folder in model.path"]
    warnings = []
    ok([m + "use_dist_checkpointing=true", m + "dist_checkpointing_path=/ckpt", A + "use_kl_loss=true"],
       warnings=warnings)
    assert warnings == [f"{m}use_dist_checkpointing=True but actor_rollout_ref.ref.megatron.use_dist_checkpointing="
                        f"False: the reference policy starts from model.path's HF weights, not from the actor's "
                        f"checkpoint"]
    warnings = []
    ok([m + "use_dist_checkpointing=true", m + "dist_checkpointing_path=/ckpt", A + "use_kl_loss=true",
        "actor_rollout_ref.ref.megatron.use_dist_checkpointing=true",
        "actor_rollout_ref.ref.megatron.dist_checkpointing_path=/ckpt"], warnings=warnings)
    assert warnings == []


def test_lora_keys_take_verls_forms():
    """target_modules as verl writes it: all-linear, a comma-separated string or a list; rank 0
    (off) validates with any of them."""
    from megappo.models import lora_targets

    for value, want in (("all-linear", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
                        ("q_proj,v_proj", ["q_proj", "v_proj"]), ("[gate_proj, up_proj]", ["gate_proj", "up_proj"])):
        cfg = ok([f"actor_rollout_ref.model.target_modules={value}", "actor_rollout_ref.model.exclude_modules=[k_proj]"])
        m = cfg.actor_rollout_ref.model
        assert lora_targets(m.target_modules, m.exclude_modules) == [n for n in want if n != "k_proj"]
    cfg = ok()
    assert (cfg.actor_rollout_ref.model.lora_rank, cfg.actor_rollout_ref.model.lora_alpha) == (0, 16)
    assert cfg.actor_rollout_ref.model.target_modules == ["all-linear"] and cfg.critic.model.lora_rank == 0


def test_verls_megatron_bridge_lora_block_is_inert_at_rank_0_and_refused_above():
    """verl's Megatron configs also carry a Megatron-Bridge block (model.lora.rank, alpha, ...):
    accepted while its rank is 0 (verl's default), refused with megappo's keys named otherwise."""
    from megappo.config import load_config

    load_config(["actor_rollout_ref.model.lora.rank=0", "actor_rollout_ref.model.lora.alpha=32",
                 "critic.model.lora.target_modules=[linear_qkv]"], ["tiny_cpu"])
    for key, value in (("critic.model.lora.rank", "8"), ("actor_rollout_ref.model.lora.adapter_path", "/tmp/a")):
        with pytest.raises(ConfigError) as ei:
            load_config([f"{key}={value}"], ["tiny_cpu"])
        assert "Megatron-Bridge LoRA setting" in dict(ei.value.errors)[key]
        assert "actor_rollout_ref.model.lora_rank" in dict(ei.value.errors)[key]
