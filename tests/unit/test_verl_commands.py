"""verl users' launch commands, verbatim (tests/unit/verl_commands.py), through
`python -m megappo.train --dry-run` with no --config: the Megatron ones run unchanged unless they
use a feature megappo lacks, and then the error names each such key and says so; the FSDP ones
are told megappo is Megatron-only and which keys replace theirs."""
import contextlib
import io

import pytest
import yaml

from verl_commands import VERL_COMMANDS

# Keys that name features megappo lacks, per command (every other key must be accepted).
LACKING = {
    "examples/grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh": None,  # MoE: filled in below
}
DIST_CKPT = "examples/ppo_trainer/run_qwen1.5_moe_a2.7b-gsm8k_megatron.sh"   # starts from verl's mcore checkpoint
MOE = "examples/grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh"
SAYS_WHY = ("not supported", "Megatron-only", "must be False", "must be 1", "issue ")


@pytest.fixture(autouse=True)
def _hub_offline(monkeypatch):
    """The commands name hub ids (Qwen/Qwen2-7B-Instruct, ...): offline, a dry run says at once that
    they are not cached, instead of retrying an unreachable hub for ~23 s per command."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def dry_run(argv):
    from megappo import train

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = train.main(["--dry-run", *argv])
    return rc, out.getvalue(), err.getvalue()


def errors(err: str) -> dict:
    """key -> message of each listed configuration error."""
    out = {}
    for line in err.splitlines():
        if line.startswith("  - "):
            key, msg = line[4:].split(": ", 1)
            out[key] = msg
    return out


def _same(parsed, text: str) -> bool:
    try:
        return float(parsed) == float(text)
    except (TypeError, ValueError):
        return str(parsed).lower() == str(yaml.safe_load(text)).lower()


def _key(arg: str) -> str:
    return arg.split("=", 1)[0].lstrip("+")


def test_the_collection_is_what_the_issue_asks_for():
    kinds = [c["kind"] for c in VERL_COMMANDS]
    assert len(VERL_COMMANDS) >= 8 and kinds.count("megatron") >= 4 and kinds.count("fsdp") >= 3
    assert "quickstart" in kinds and {c["algo"] for c in VERL_COMMANDS} >= {"gae", "grpo"}


@pytest.mark.parametrize("cmd", [c for c in VERL_COMMANDS if c["kind"] != "fsdp"], ids=lambda c: c["source"])
def test_megatron_commands_run_unchanged_or_name_the_missing_feature(cmd):
    rc, out, err = dry_run(cmd["argv"])
    lacking = LACKING.get(cmd["source"], set())
    if cmd["source"] == MOE:
        lacking = {_key(a) for a in cmd["argv"] if "override_optimizer_config" in a}
        # megatron's CPU optimizer offload. The rest runs: EP is a setting, moe_router_dtype too, the fusion
        # switches warn, DAPO's reward_kwargs are the overlong penalty's keys, override_config.model_config's
        # max_position_embeddings is a setting.
    if not lacking:
        assert rc == 0, err
        cfg = yaml.safe_load(out[:out.index("# layout")])
        # the command's values are what megappo runs with
        for arg in cmd["argv"]:
            if arg.startswith("--") or "=" not in arg:
                continue
            key, value = arg.split("=", 1)
            node = cfg
            for part in key.lstrip("+").split("."):
                node = node.get(part) if isinstance(node, dict) else None
            if node is not None and not isinstance(node, list) and value not in ("null", "None"):
                assert _same(node, value), (key, node, value)
        for line in err.splitlines():   # accepted verl keys with no effect: one line each, saying so
            assert line.startswith("megappo: warning: ") and "effect" in line or "runs as sync" in line, line
        return
    assert rc == 2
    found = errors(err)
    assert set(found) == lacking, sorted(set(found) ^ lacking)
    for key, msg in found.items():
        assert any(w in msg for w in SAYS_WHY), (key, msg)
    # and nothing else stands in the way
    rc, _, err = dry_run([a for a in cmd["argv"] if _key(a) not in lacking])
    assert rc == 0, err


@pytest.mark.parametrize("cmd", [c for c in VERL_COMMANDS if c["kind"] == "fsdp"], ids=lambda c: c["source"])
def test_fsdp_commands_are_told_megappo_is_megatron_only(cmd):
    rc, _, err = dry_run(cmd["argv"])
    assert rc == 2
    found = errors(err)
    fsdp = {_key(a) for a in cmd["argv"] if ".fsdp_config." in a}
    assert fsdp and fsdp <= set(found)
    for key in fsdp:
        assert "megappo is Megatron-only" in found[key] and "tensor_model_parallel_size" in found[key], found[key]
        if key.endswith(("param_offload", "optimizer_offload")):   # the megatron key that replaces it
            section = key.split(".fsdp_config")[0].removesuffix(".model")
            assert f"{section}.megatron.{key.rsplit('.', 1)[1]}" in found[key], found[key]
    other = set(found) - fsdp
    assert all("not supported" in found[k] for k in other), {k: found[k] for k in other}
    rc, _, err = dry_run([a for a in cmd["argv"] if _key(a) not in set(found)])
    assert rc == 0, err


def test_values_come_through_as_verl_means_them():
    quick = next(c for c in VERL_COMMANDS if c["kind"] == "quickstart")
    rc, out, err = dry_run(quick["argv"])
    assert rc == 0, err
    cfg = yaml.safe_load(out[:out.index("# layout")])
    assert cfg["trainer"]["device"] == "cuda" and cfg["algorithm"]["adv_estimator"] == "gae"
    assert cfg["critic"]["optim"]["lr"] == 1e-5 and cfg["actor_rollout_ref"]["actor"]["optim"]["lr"] == 1e-6
    assert "world=1 (1 node(s) x 1)" in out
    first = VERL_COMMANDS[0]
    rc, out, err = dry_run(first["argv"])
    cfg = yaml.safe_load(out[:out.index("# layout")])
    assert cfg["data"]["train_files"] == ["$HOME/data/gsm8k/train.parquet", "$HOME/data/math/train.parquet"]
    assert cfg["trainer"]["logger"] == ["console", "wandb"]


def test_unknown_config_name_and_unknown_key_are_errors():
    rc, _, err = dry_run(["--config-name=my_trainer", "trainer.nnodes=1"])
    assert rc == 2 and "--config-name: 'my_trainer' is not one of verl's trainer configs" in err
    assert "nor of its example configs megappo knows ['gsm8k_multiturn_megatron_grpo']" in err
    rc, _, err = dry_run(["actor_rollout_ref.rollout.mdoe=sync"])
    assert rc == 2 and "unknown config key 'actor_rollout_ref.rollout.mdoe'" in err


@pytest.mark.parametrize("arg, kind, fragment", [
    ("actor_rollout_ref.model.enable_gradient_checkpointing=True", None, None),     # settings
    ("actor_rollout_ref.model.enable_gradient_checkpointing=False", None, None),
    ("actor_rollout_ref.model.use_remove_padding=True", None, None),   # a setting
    ("reward_model.model.use_remove_padding=True", None, None),
    ("actor_rollout_ref.actor.megatron.param_offload=True", None, None),
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform", None, None),
    ("actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=True", "warn",
     "megappo runs megatron's unfused paths"),
    ("+critic.megatron.override_transformer_config.gradient_accumulation_fusion=False", None, None),
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.deallocate_pipeline_outputs=True", "warn",
     "keeps megatron's default"),
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.hidden_dropout=0.1", "error",
     "only recompute_granularity, recompute_method, recompute_num_layers, the uneven pipeline's "
     "num_layers_in_first_pipeline_stage"),
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=3", None, None),
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.account_for_loss_in_pipeline_split=True", None, None),
    ("actor_rollout_ref.actor.megatron.expert_model_parallel_size=2", None, None),   # settings
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype=fp32", None, None),
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.001", None, None),
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=True", None, None),
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.moe_token_dispatcher_type=alltoall", None, None),
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.moe_token_dispatcher_type=flex", "warn",
     "alltoall dispatcher"),
    ("+actor_rollout_ref.actor.megatron.override_transformer_config.moe_enable_deepep=True", "warn", "DeepEP"),
    ("critic.megatron.optimizer_offload=False", None, None),
    ("actor_rollout_ref.hybrid_engine=True", None, None),
    ("actor_rollout_ref.hybrid_engine=False", None, None),   # a setting (the split placement)
    ("rollout.n_gpus_per_node=2", None, None),
    ("model_engine=megatron", None, None),
    ("model_engine=fsdp", "error", "Megatron-only"),
    ("actor_rollout_ref.rollout.mode=sync", None, None),
    ("actor_rollout_ref.actor.megatron.context_parallel_size=1", None, None),
    ("actor_rollout_ref.actor.megatron.context_parallel_size=2", None, None),   # a setting
    ("actor_rollout_ref.actor.megatron.use_dist_checkpointing=False", None, None),
    ("trainer.default_hdfs_dir=null", None, None),
    ("trainer.default_hdfs_dir=hdfs://x", "error", "HDFS copies are not supported"),
    ("+ray_kwargs.ray_init.num_cpus=8", "warn", "megappo.launch.ray"),
    ("actor_rollout_ref.actor.strategy=fsdp", "error", "Megatron-only"),
    ("critic.model.fsdp_config.param_offload=True", "error", "critic.megatron.param_offload"),
    ("reward_model.reward_manager=dapo", None, None),
    ("reward_model.reward_manager=prime", None, None),
    ("reward_model.reward_manager=sandbox", "error", "expected one of 'naive', 'dapo', 'batch', 'prime'"),
    ("+reward_model.reward_kwargs.overlong_buffer_cfg.len=4096", None, None),   # reward_model.overlong_buffer.len
    ("+reward_model.reward_kwargs.overlong_buffer_cfg.log=True", None, None),
    ("+reward_model.reward_kwargs.overlong_buffer_cfg.size=4", "error", "takes enable, len, penalty_factor and log"),
    ("+reward_model.reward_kwargs.max_resp_len=4096", None, None),   # reward_model.overlong_buffer.max_resp_len
    ("algorithm.rollout_correction.rollout_rs=token_k1", None, None),          # settings now (validated:
    ("algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0", None, None),  # test_rollout_rs_and_reinforce)
    ("algorithm.rollout_correction.loss_type=reinforce", None, None),
    ("+actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.0002", None, None),   # a setting now (clip_cov)
    ("+actor_rollout_ref.actor.calculate_sum_pi_squared=True", None, None),
    # multi-turn: verl's keys are settings, those megappo lacks are refused unless verl's default
    ("data.return_raw_chat=True", None, None),
    ("actor_rollout_ref.rollout.multi_turn.format=hermes", None, None),
    ("actor_rollout_ref.rollout.multi_turn.max_parallel_calls=2", None, None),
    ("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=left", None, None),
    ("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=top", "error",
     "expected one of 'left', 'middle', 'right'"),
    ("actor_rollout_ref.rollout.multi_turn.format=llama3_json", "error", "expected one of 'hermes'"),
    ("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=False", None, None),
    ("actor_rollout_ref.rollout.multi_turn.use_inference_chat_template=True", "error",
     "continue from the token ids the model produced"),
    ("actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=strict", None, None),
    ("actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode=loose", "error",
     "must be strict, ignore_strippable or disable"),
    ("+actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=null", None, None),
    ("+actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts=4", "error", "actor_rollout_ref.rollout.n"),
    ("+actor_rollout_ref.rollout.multi_turn.completion_callback=a.b", "error", "completion callbacks"),
    ("+actor_rollout_ref.rollout.multi_turn.max_turns=3", "error", "multi-turn settings are enable, max_assistant_turns"),
])
def test_each_verl_only_key(arg, kind, fragment):
    from megappo.config import load_config

    warnings, errs = [], []
    load_config([arg], ["tiny_cpu"], raise_errors=False, errors=errs, warnings=warnings)
    key = _key(arg)
    if kind is None:
        assert not errs and not warnings, (errs, warnings)
    elif kind == "warn":
        assert not errs and len(warnings) == 1 and warnings[0].startswith(key) and fragment in warnings[0], warnings
    else:
        assert not warnings and len(errs) == 1 and errs[0][0] == key and fragment in errs[0][1], errs


@pytest.mark.parametrize("args, key, fragment", [
    (["rollout_rs=token_k1,seq_mean_k3", "rollout_rs_threshold=0.5_2.0,0.01"], None, None),
    (["bypass_mode=true", "loss_type=reinforce", "rollout_is=sequence"], None, None),
    (["bypass_mode=true", "loss_type=reinforce", "rollout_is=sequence", "rollout_rs=seq_mean_k1",
      "rollout_rs_threshold=0.999_1.001"], None, None),
    (["rollout_rs=token_k1"], "rollout_rs_threshold", "is required with rollout_rs=token_k1"),
    (["rollout_rs=token_k5", "rollout_rs_threshold=2"], "rollout_rs", "unknown option 'token_k5'"),
    (["rollout_rs=seq_max_k1", "rollout_rs_threshold=2"], "rollout_rs", "unknown option 'seq_max_k1'"),
    (["rollout_rs=token_k2", "rollout_rs_threshold=0.5_2.0"], "rollout_rs_threshold", "takes one upper bound"),
    (["loss_type=pg"], "loss_type", "expected one of 'ppo_clip', 'reinforce'"),
])
def test_rollout_rs_and_reinforce(args, key, fragment):
    """verl's rejection sampling and bypass-mode REINFORCE keys are settings: a verl command with
    valid ones runs (dry run), a bad option or bound is refused naming its key."""
    quick = next(c for c in VERL_COMMANDS if c["kind"] == "quickstart")
    rc, out, err = dry_run(quick["argv"] + ["algorithm.rollout_correction." + a for a in args])
    if key is None:
        assert rc == 0, err
        cfg = yaml.safe_load(out[:out.index("# layout")])["algorithm"]["rollout_correction"]
        for a in args:
            k, v = a.split("=", 1)
            assert _same(cfg[k], v), (k, cfg[k], v)
        return
    assert rc == 2
    found = errors(err)
    assert set(found) == {"algorithm.rollout_correction." + key} and fragment in found["algorithm.rollout_correction." + key], found


def test_verl_memory_keys_are_settings():
    """verl's offload and recomputation keys set megappo's fields, and
    enable_gradient_checkpointing means full recomputation of every layer."""
    from megappo.builders import recompute_settings
    from megappo.config import load_config

    cfg = load_config(["actor_rollout_ref.model.enable_gradient_checkpointing=True",
                       "critic.megatron.override_transformer_config.recompute_granularity=selective",
                       "actor_rollout_ref.actor.megatron.param_offload=True", "critic.megatron.grad_offload=True"],
                      ["tiny_cpu"])
    assert cfg.actor_rollout_ref.actor.megatron.param_offload and cfg.critic.megatron.grad_offload
    assert not cfg.critic.megatron.param_offload   # each role's own, not inherited from the actor
    arr = cfg.actor_rollout_ref
    assert recompute_settings(arr.actor.megatron, arr.model.enable_gradient_checkpointing) == ("full", "uniform", 1)
    assert recompute_settings(cfg.critic.megatron, False) == ("selective", "uniform", 1)
    assert recompute_settings(arr.ref.megatron, True) is None     # forward only
    assert recompute_settings(arr.actor.megatron, False) is None



def test_cuda_graphs_by_default_on_gpu_eager_on_cpu():
    from megappo.builders import enforce_eager
    from megappo.config import load_config

    assert enforce_eager(load_config([])) is False                     # trainer.device=cuda
    assert enforce_eager(load_config([], ["tiny_cpu"])) is True
    assert enforce_eager(load_config(["actor_rollout_ref.rollout.enforce_eager=True"])) is True
    assert enforce_eager(load_config(["actor_rollout_ref.rollout.enforce_eager=False"], ["tiny_cpu"])) is False


def test_the_dist_checkpointing_command_starts_when_its_checkpoint_exists(tmp_path):
    """The real start's path checks on verl's use_dist_checkpointing command: its three roles'
    dist_checkpointing_path must be a dist_checkpointing folder (metadata.json) for each role the
    run builds (the actor and the critic: with no KL term there is no reference, as in verl); the
    model folder, data files and world size are another machine's, so only these keys are looked at."""
    from megappo import train
    from megappo.config import ConfigError

    cmd = next(c for c in VERL_COMMANDS if c["source"] == DIST_CKPT)
    keys = {_key(a) for a in cmd["argv"] if ".dist_checkpointing_path=" in a}
    assert keys == {"actor_rollout_ref.actor.megatron.dist_checkpointing_path",
                    "actor_rollout_ref.ref.megatron.dist_checkpointing_path", "critic.megatron.dist_checkpointing_path"}

    built = keys - {"actor_rollout_ref.ref.megatron.dist_checkpointing_path"}

    def path_errors(ckpt):
        argv = [f"{_key(a)}={ckpt}" if _key(a) in keys else a for a in cmd["argv"]]
        with pytest.raises(ConfigError) as e:   # the model folder and data files are another machine's
            train.build_config(train.parse_args(argv))
        return {k: m for k, m in e.value.errors if k in keys}

    assert {k: m.split(" [")[0] for k, m in path_errors(tmp_path / "none").items()} == {
        k: f"checkpoint directory not found: {tmp_path / 'none'}" for k in built}
    (tmp_path / "empty").mkdir()
    assert all("is not a megatron-core dist_checkpointing folder (no metadata.json" in m
               for m in path_errors(tmp_path / "empty").values()) and len(path_errors(tmp_path / "empty")) == 2
    ckpt = tmp_path / "mcore"
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    assert path_errors(ckpt) == {}


def test_verls_megatron_multi_turn_gsm8k_command(tmp_path):
    """verl's multi-turn GSM8K Megatron example, unchanged: its --config-name is known (its
    settings apply), rollout.name=sglang runs as vLLM with a warning naming the substitution, and
    and its context parallelism (CP=2 for the actor and the reference) is megappo's own."""
    from verl_commands import VERL_GSM8K_TOOL_CONFIG, VERL_MULTI_TURN_COMMAND

    tools = tmp_path / "examples/sglang_multiturn/config/tool_config/gsm8k_tool_config.yaml"
    tools.parent.mkdir(parents=True)
    tools.write_text(VERL_GSM8K_TOOL_CONFIG)
    argv = [a.replace("$PROJECT_DIR", str(tmp_path)) for a in VERL_MULTI_TURN_COMMAND["argv"]]
    rc, out, err = dry_run(argv)
    assert rc == 0, err
    cfg = yaml.safe_load(out[:out.index("# layout")])
    ro = cfg["actor_rollout_ref"]["rollout"]
    assert ro["name"] == "vllm" and ro["n"] == 8 and ro["tensor_model_parallel_size"] == 2
    assert ro["multi_turn"]["enable"] is True and ro["multi_turn"]["max_assistant_turns"] == 5   # its --config-name
    assert ro["multi_turn"]["tool_config_path"] == str(tools)
    assert cfg["data"]["train_batch_size"] == 1024 and cfg["algorithm"]["adv_estimator"] == "grpo"
    meg = cfg["actor_rollout_ref"]["actor"]["megatron"]
    assert (meg["tensor_model_parallel_size"], meg["pipeline_model_parallel_size"],
            meg["virtual_pipeline_model_parallel_size"], meg["context_parallel_size"]) == (2, 2, 2, 2)
    assert cfg["actor_rollout_ref"]["ref"]["megatron"]["context_parallel_size"] == 2
    assert "train: TP=2 PP=2 VPP=2 CP=2 DP=1 | rollout: TP=2 DP=4" in out
    warned = [line for line in err.splitlines() if line.startswith("megappo: warning: ")]
    assert [w for w in warned if "sglang" in w] == [
        "megappo: warning: actor_rollout_ref.rollout.name=sglang runs as actor_rollout_ref.rollout.name=vllm: "
        "megappo rolls out with vLLM, not SGLang (the same sampling settings: n, temperature, top_p, top_k; "
        "multi-turn tool calls run in megappo's own loop over the vLLM engine)"], warned


def test_dapo_reward_kwargs_are_the_overlong_penalty():
    """verl's DAPO reward manager arguments (reward_kwargs.overlong_buffer_cfg.*, max_resp_len) are
    megappo's overlong penalty: a buffer of 4 ending at max_resp_len 8 (not at
    data.max_response_length 10) costs a response of 8 tokens the whole factor, one of 4 nothing."""
    from types import SimpleNamespace

    import torch

    from megappo.batch import RolloutBatch
    from megappo.config import load_config, validate
    from megappo.data import PromptItem
    from megappo.metrics import Timer
    from megappo.trainer.scoring import Scorer

    kw = "+reward_model.reward_kwargs."
    cfg = load_config(["data.max_response_length=10", "reward_model.reward_manager=dapo",
                       kw + "overlong_buffer_cfg.enable=True", kw + "overlong_buffer_cfg.len=4",
                       kw + "overlong_buffer_cfg.penalty_factor=2.0", kw + "overlong_buffer_cfg.log=False",
                       kw + "max_resp_len=8"], ["tiny_cpu"])
    validate(cfg)
    ob = cfg.reward_model.overlong_buffer
    assert (ob.enable, ob.len, ob.penalty_factor, ob.max_resp_len) == (True, 4, 2.0, 8)
    mask = torch.zeros(2, 10)
    mask[0, :4], mask[1, :8] = 1, 1
    batch = RolloutBatch.from_prompts_and_responses([[5, 6], [5, 7]], torch.full((2, 10), 9), mask, 0)
    items = [PromptItem([5, 6], "src", "a"), PromptItem([5, 7], "src", "a")]
    scorer = Scorer(cfg, SimpleNamespace(decode=lambda ids, skip_special_tokens: "text"), lambda *a: 1.0, None,
                    None, None, None, lambda stage, **t: None, Timer())
    scores = scorer(batch, items)
    assert scores.per_sample["seq_reward"].tolist() == [1.0, 1.0 - 2.0]
    assert scores.token_level[1, 7] == -1.0 and scores.metrics["reward/overlong_fraction"] == 0.5


def test_a_verl_commands_own_config_file_is_read_with_its_hydra_header(tmp_path):
    """--config-path/--config-name naming a file that is there: the file is read as verl reads it
    (its defaults: verl's trainer config, whose defaults megappo's are; its hydra search path
    dropped), under the command line's overrides; a defaults entry megappo cannot follow is named."""
    conf = tmp_path / "config"
    conf.mkdir()
    (conf / "interaction_config").mkdir()
    (conf / "interaction_config" / "gsm8k.yaml").write_text(
        "interaction:\n  - name: gsm8k\n    class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n"
        "    config: {}\n")
    # verl's examples/sglang_multiturn/config/gsm8k_multiturn_grpo_w_interaction.yaml (b178a3c)
    (conf / "gsm8k_multiturn_grpo_w_interaction.yaml").write_text(
        "hydra:\n  searchpath:\n    - file://verl/trainer/config\n\ndefaults:\n  - ppo_trainer\n  - _self_\n\n"
        "data:\n  max_prompt_length: 1024\n  max_response_length: 1024\n  train_batch_size: 256\n"
        "  return_raw_chat: True\n\nactor_rollout_ref:\n  hybrid_engine: True\n  rollout:\n    name: sglang\n"
        "    multi_turn:\n      enable: True\n      max_user_turns: 5\n")
    rc, out, err = dry_run([f"--config-path={conf}", "--config-name=gsm8k_multiturn_grpo_w_interaction",
                            "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct", "data.train_batch_size=64",
                            "actor_rollout_ref.actor.ppo_mini_batch_size=16",
                            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
                            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "algorithm.adv_estimator=grpo",
                            "actor_rollout_ref.rollout.n=4",
                            f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={conf}/interaction_config/gsm8k.yaml"])
    assert rc == 0, err
    cfg = yaml.safe_load(out[:out.index("# layout")])
    mt = cfg["actor_rollout_ref"]["rollout"]["multi_turn"]
    assert mt["enable"] is True and mt["max_user_turns"] == 5 and mt["interaction_config_path"].endswith("gsm8k.yaml")
    assert cfg["data"]["max_response_length"] == 1024 and cfg["data"]["train_batch_size"] == 64   # the command wins
    (conf / "odd.yaml").write_text("defaults:\n  - ppo_trainer\n  - override data: mine\n  - _self_\n")
    rc, out, err = dry_run([f"--config-path={conf}", "--config-name=odd"])
    assert rc != 0 and "defaults entry {'override data': 'mine'} is not supported" in err
    rc, out, err = dry_run([f"--config-path={conf}", "--config-name=missing"])
    assert rc != 0 and f"no {conf}/missing.yaml and 'missing' is not one of verl's trainer configs" in err
