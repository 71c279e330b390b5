"""Every key of verl's own Megatron trainer config gets an answer: a megappo setting, verl's value
mapped to one, or, for a key megappo has no field for, accepted at verl's default and judged when
set to anything else (warned where it changes nothing here, refused with the reason otherwise).
verl's file is test data (verl_ppo_megatron_trainer.yaml, verl b178a3c)."""
from pathlib import Path

import pytest
import yaml

from megappo.config import ConfigError, load_config
from megappo.config import verl_defaults
from megappo.config.parse import verl_compat
from megappo.config.yamlio import yaml_load

VERL_FILE = Path(__file__).with_name("verl_ppo_megatron_trainer.yaml")
LEAVES = [(k, v) for k, v in verl_defaults.leaves(yaml_load(VERL_FILE.read_text())) if v != "???"]

# what megappo says of verl's defaults, and only these: each names a real difference
DEFAULT_WARNINGS = ["actor_rollout_ref.actor.megatron.use_mbridge=True has no effect",
                    "actor_rollout_ref.actor.use_torch_compile=True has no effect",
                    "actor_rollout_ref.ref.use_torch_compile=True has no effect",
                    "actor_rollout_ref.rollout.mode='async' runs as sync",
                    "data.seed=null runs as data.seed=1",
                    "critic.megatron.use_mbridge=True has no effect"]


def _text(v) -> str:
    """A YAML value as a verl command line writes it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, dict)):
        return yaml.safe_dump(v, default_flow_style=True).strip()
    return str(v)


def test_verls_whole_megatron_config_loads_as_a_config_file():
    """A user's copy of verl's config (every key at verl's default) runs: no error, and warnings
    only where megappo does something else than the value says."""
    warnings = []
    cfg = load_config([], [str(VERL_FILE)], warnings=warnings)
    assert len(warnings) == len(DEFAULT_WARNINGS), warnings
    for want, got in zip(DEFAULT_WARNINGS, warnings):
        assert got.startswith(want), (want, got)
    # verl's ${oc.select:...} and ${.key} forms resolve: the critic follows the actor where verl's does
    assert cfg.critic.ppo_epochs == cfg.actor_rollout_ref.actor.ppo_epochs
    assert cfg.critic.ppo_mini_batch_size == cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    assert cfg.critic.forward_max_token_len_per_gpu == cfg.critic.ppo_max_token_len_per_gpu
    assert cfg.critic.ppo_micro_batch_size_per_gpu is None     # ${oc.select:.ppo_micro_batch_size,null}: no such key
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"
    # verl's rollout keys that are vLLM's arguments, at their defaults: megappo's engine as before
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm == {
        "max_model_len": None, "enable_prefix_caching": True, "disable_log_stats": True,
        "cudagraph_capture_sizes": None, "scheduling_policy": "fcfs"}


@pytest.mark.parametrize("key, value", LEAVES, ids=[k for k, _ in LEAVES])
def test_each_key_at_verls_default_is_answered_on_the_command_line(key, value):
    status, _, what = verl_compat(f"{key}={_text(value)}")
    assert status in ("set", "mapped", "accepted", "warned"), (status, what)
    if status == "warned":
        assert any(w.startswith(f"{key}=") for w in DEFAULT_WARNINGS) or key.endswith("ref.use_torch_compile"), what


def test_the_defaults_table_is_verls_file():
    """megappo.config.verl_defaults holds exactly verl's defaults of the keys megappo lacks
    (python -m megappo.config.verl_defaults regenerates it from verl's file)."""
    assert verl_defaults.table_of(str(VERL_FILE)) == verl_defaults.DEFAULTS
    assert len(verl_defaults.DEFAULTS) > 350


@pytest.mark.parametrize("override, status, fragment", [
    # no effect here: a warning naming what megappo does instead
    ("actor_rollout_ref.actor.profiler.enable=true", "warned", "has no effect: megappo has no profiler hooks"),
    ("global_profiler.steps=[1,2]", "warned", "has no effect: megappo has no profiler hooks"),
    ("actor_rollout_ref.nccl_timeout=1200", "warned", "trainer.dist_timeout_s"),
    ("data.dataloader_num_workers=4", "warned", "tokenizes every row once at start"),
    ("actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=fa3", "warned", "rolls out with vLLM"),
    ("actor_rollout_ref.rollout.load_format=safetensors", "warned", "dummy weights"),
    ("reward_model.num_workers=8", "warned", "scores each sample once, the batch spread over the training ranks"),
    ("reward_model.launch_reward_fn_async=true", "warned", "scores the batch right after generation"),
    ("actor_rollout_ref.actor.checkpoint.async_save=true", "refused", "megappo saves synchronously"),
    # a feature megappo lacks: refused, saying so and naming verl's default
    ("actor_rollout_ref.model.mtp.enable=true", "refused", "megappo has no setting for it (verl's default, False, is accepted)"),
    ("algorithm.use_pf_ppo=true", "refused", "megappo has no setting for it (verl's default, False, is accepted)"),
    ("actor_rollout_ref.actor.router_replay.mode=R2", "refused", "verl's default, 'disabled'"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size=8", "refused", "set actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
    ("actor_rollout_ref.rollout.response_length=1024", "refused", "megappo's is data.max_response_length"),
    ("data.tokenizer=/tok", "refused", "the tokenizer is actor_rollout_ref.model.path's"),
    # verl's vLLM arguments in the rollout section: megappo's engine_kwargs.vllm
    ("actor_rollout_ref.rollout.enable_prefix_caching=false", "mapped",
     "sets actor_rollout_ref.rollout.engine_kwargs.vllm.enable_prefix_caching"),
    ("actor_rollout_ref.rollout.max_model_len=8192", "mapped", "sets actor_rollout_ref.rollout.engine_kwargs.vllm.max_model_len"),
    # verl keys megappo now has
    ("trainer.val_only=true", "set", "a megappo key"),
    ("actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]", "set", "a megappo key"),
    ("reward_model.reward_manager=prime", "set", "a megappo key"),
    ("data.train_max_samples=100", "set", "a megappo key"),
    ("actor_rollout_ref.model.custom_chat_template='{{ messages }}'", "set", "a megappo key"),
])
def test_a_key_set_away_from_verls_default(override, status, fragment):
    got, key, what = verl_compat(override)
    assert (got, key) == (status, override.split("=")[0]) and fragment in what, (got, what)


def test_refusals_of_keys_away_from_their_default_name_them_on_a_run():
    with pytest.raises(ConfigError) as ei:
        load_config(["actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.tiled_mlp.enabled=false"])
    assert [k for k, _ in ei.value.errors] == ["actor_rollout_ref.model.mtp.enable"]   # the default passes
    cfg = load_config(["actor_rollout_ref.rollout.enable_prefix_caching=false",
                       "actor_rollout_ref.rollout.max_model_len=null"])
    assert cfg.actor_rollout_ref.rollout.engine_kwargs.vllm == {"enable_prefix_caching": False, "max_model_len": None}


def test_hydras_required_marker_leaves_megappos_default(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("actor_rollout_ref:\n  rollout:\n    name: ???\n    n: 3\nreward_model:\n  rollout:\n    name: ???\n")
    cfg = load_config([], [str(f)])
    assert cfg.actor_rollout_ref.rollout.name == "vllm" and cfg.actor_rollout_ref.rollout.n == 3


FSDP_FILE = Path(__file__).with_name("verl_ppo_trainer.yaml")
FSDP_LEAVES = [(k, v) for k, v in verl_defaults.leaves(yaml_load(FSDP_FILE.read_text())) if v != "???"]


def test_every_key_of_verls_fsdp_config_is_answered():
    """verl's FSDP trainer config: no key is unknown; a refusal says megappo is Megatron-only or
    names the megappo keys that take its place; verl's FSDP gradient clip is megappo's clip_grad."""
    refused = {}
    for key, value in FSDP_LEAVES:
        status, _, what = verl_compat(f"{key}={_text(value)}")
        assert status != "unknown", (key, what)
        if status == "refused":
            refused[key] = what
    assert all("Megatron-only" in w or "megappo's (megatron's) schedule keys are" in w for w in refused.values()), refused
    assert {k.rsplit(".", 1)[-1] for k in refused if "fsdp_config" not in k} == {
        "optimizer_impl", "min_lr_ratio", "num_cycles", "lr_scheduler_type", "warmup_style", "strategy"}
    assert verl_compat("actor_rollout_ref.actor.grad_clip=0.5") == (
        "mapped", "actor_rollout_ref.actor.grad_clip", "sets actor_rollout_ref.actor.optim.clip_grad")
    assert load_config(["critic.grad_clip=0.25"]).critic.optim.clip_grad == 0.25
