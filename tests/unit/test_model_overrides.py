"""override_config.model_config: the merged config.json (verl's nested semantics), the folder every
reader sees, and what is refused."""
import json
import os
import subprocess
import sys

import pytest

QWEN = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
        "max_position_embeddings": 512, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "text_config": {"a": 1, "b": {"c": 2}}}


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAPPO_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "qwen"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN))
    (d / "tokenizer.json").write_text("{}")
    (d / "sub").mkdir()
    (d / "sub" / "x.bin").write_bytes(b"1234")
    return str(d)


def test_merge_is_verls_nested_update_and_the_rope_base_lands_where_transformers_reads_it():
    from megappo.models.overrides import merged_config

    got = merged_config(QWEN, {"max_position_embeddings": 1024, "text_config": {"b": {"d": 3}},
                               "rope_theta": 500.0, "new": [1, 2]})
    assert got["max_position_embeddings"] == 1024 and got["new"] == [1, 2]
    assert got["text_config"] == {"a": 1, "b": {"c": 2, "d": 3}}           # merged, not replaced
    assert got["rope_theta"] == 500.0 and got["rope_parameters"] == {"rope_type": "default", "rope_theta": 500.0}
    assert QWEN["text_config"] == {"a": 1, "b": {"c": 2}} and QWEN["rope_parameters"]["rope_theta"] == 10000.0
    # a transformers-4 file (no rope_parameters) keeps its shape
    old = {k: v for k, v in QWEN.items() if k != "rope_parameters"}
    assert "rope_parameters" not in merged_config(old, {"rope_theta": 500.0})
    # a scalar over a mapping replaces it, as verl's setattr does
    assert merged_config(QWEN, {"text_config": None})["text_config"] is None


def test_the_folder_links_the_source_and_holds_the_merged_config(folder, tmp_path):
    from megappo.models import overridden_folder

    assert overridden_folder(folder, {}) == folder
    out = overridden_folder(folder, {"max_position_embeddings": 2048})
    assert out.startswith(str(tmp_path / "cache" / "model_overrides" / "qwen-"))
    assert overridden_folder(folder, {"max_position_embeddings": 2048}) == out
    assert sorted(os.listdir(out)) == ["config.json", "sub", "tokenizer.json"]
    assert os.path.islink(os.path.join(out, "tokenizer.json")) and not os.path.islink(os.path.join(out, "config.json"))
    assert open(os.path.join(out, "sub", "x.bin"), "rb").read() == b"1234"
    assert json.load(open(os.path.join(out, "config.json")))["max_position_embeddings"] == 2048
    assert json.load(open(os.path.join(folder, "config.json"))) == QWEN
    assert overridden_folder(folder, {"max_position_embeddings": 4096}) != out
    assert not [n for n in os.listdir(os.path.dirname(out)) if n.startswith(".tmp-")]


def test_every_process_reads_one_folder_and_a_stale_one_is_remade(folder, tmp_path):
    """The name depends on the source and the entries only (vLLM's compile cache keys on the
    model's path); a folder left with other contents (the source changed) is replaced."""
    from megappo.models import overridden_folder

    code = ("import sys\nfrom megappo.models import overridden_folder\n"
            f"print(overridden_folder({folder!r}, {{'rms_norm_eps': 1e-5}}))\n")
    env = dict(os.environ)
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout.strip()
            for _ in range(2)]
    assert runs[0] == runs[1] and os.path.isdir(runs[0])
    assert overridden_folder(folder, {"rms_norm_eps": 1e-5}) == runs[0]
    (tmp_path / "qwen" / "vocab.txt").write_text("a")   # the source gained a file: the links are stale
    from megappo.models import overrides

    overrides._overlays.clear()
    again = overridden_folder(folder, {"rms_norm_eps": 1e-5})
    assert again == runs[0] and os.path.islink(os.path.join(again, "vocab.txt"))
    assert sorted(os.listdir(folder)) == ["config.json", "sub", "tokenizer.json", "vocab.txt"]


def test_check_reads_the_merged_config_through_transformers(folder):
    from megappo.models import check_overrides

    c = check_overrides(folder, {"rope_theta": 500.0, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5})
    assert c.rope_parameters["rope_theta"] == 500.0 and c.max_position_embeddings == 4096 and c.rms_norm_eps == 1e-5
    c = check_overrides(folder, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert c.rope_parameters["rope_type"] == "linear" and c.rope_parameters["factor"] == 2.0
    assert str(check_overrides(folder, {"dtype": "bfloat16"}).dtype) == "torch.bfloat16"


@pytest.mark.parametrize("overrides, message", [
    ({"vocab_size": 256, "hidden_size": 32}, "vocab_size: changes the shapes of the model's weights (the folder's "
                                             "safetensors would not load); entries that may be set are"),
    ({"sliding_window": 128}, "sliding_window: set in config.json but not what transformers reads (not an entry of "
                              "Qwen3Config, or one it derives from others)"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported (SwiGLU with silu only)"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn' is not supported"),
])
def test_check_names_what_cannot_be(folder, overrides, message):
    from megappo.models import ModelConfigError, check_overrides

    with pytest.raises(ModelConfigError) as e:
        check_overrides(folder, overrides)
    assert message in str(e.value), str(e.value)


def test_a_good_override_passes_a_real_start(tmp_path, folder):
    from megappo.config import load_config, validate

    (tmp_path / "t.parquet").write_bytes(b"x")
    cfg = load_config([f"actor_rollout_ref.model.path={folder}", f"data.train_files=[{tmp_path}/t.parquet]",
                       f"data.val_files=[{tmp_path}/t.parquet]", "data.max_response_length=1000",
                       "actor_rollout_ref.rollout.max_num_batched_tokens=2048",
                       "actor_rollout_ref.model.override_config.model_config.max_position_embeddings=1064",
                       "critic.model.override_config.model_config.rope_theta=100.0"], ["tiny_cpu"])
    validate(cfg, check_paths=True)
    assert cfg.actor_rollout_ref.model.override_config.model_config == {"max_position_embeddings": 1064}
    assert cfg.critic.model.override_config.model_config == {"rope_theta": 100.0}


@pytest.mark.parametrize("extra, env", [
    (["actor_rollout_ref.model.override_config.model_config.rope_scaling={rope_type: linear, factor: 2.0}"], {}),
    ([], {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}),
    (["actor_rollout_ref.rollout.engine_kwargs.vllm.hf_overrides={max_position_embeddings: 4096}"], {}),
])
def test_a_longer_context_than_the_positions_passes_where_vllm_takes_it(tmp_path, folder, monkeypatch, extra, env):
    """512 positions and a 1,064-token context: RoPE scaling (given over a file whose
    rope_parameters say default), vLLM's own switch, or vLLM's hf_overrides make it one vLLM runs."""
    from megappo.config import ConfigError, load_config, validate

    (tmp_path / "t.parquet").write_bytes(b"x")
    base = [f"actor_rollout_ref.model.path={folder}", f"data.train_files=[{tmp_path}/t.parquet]",
            f"data.val_files=[{tmp_path}/t.parquet]", "data.max_response_length=1000",
            "actor_rollout_ref.rollout.max_num_batched_tokens=2048"]
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        validate(load_config(base, ["tiny_cpu"]), check_paths=True)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    validate(load_config(base + extra, ["tiny_cpu"]), check_paths=True)


def test_verls_flat_entries_and_a_mapping_on_the_command_line():
    """verl's new model engine reads override_config's own entries as config.json's (20 of its
    scripts: +actor_rollout_ref.model.override_config.max_position_embeddings=...); a whole
    mapping given on the command line sets its entries, each named where it fails."""
    from megappo.config import ConfigError, load_config
    from megappo.config.parse import source_of, verl_compat

    cfg = load_config(["+actor_rollout_ref.model.override_config.max_position_embeddings=32768",
                       "critic.model.override_config={model_config: {rope_theta: 5.0}}"])
    assert cfg.actor_rollout_ref.model.override_config.model_config == {"max_position_embeddings": 32768}
    assert cfg.critic.model.override_config.model_config == {"rope_theta": 5.0}
    assert verl_compat("+actor_rollout_ref.model.override_config.max_position_embeddings=32768")[0] == "mapped"
    with pytest.raises(ConfigError) as e:
        load_config(["actor_rollout_ref.model.override_config={model_config: {x: 1}, moe_config: {freeze_moe_router: true}}"])
    assert [k for k, _ in e.value.errors] == ["actor_rollout_ref.model.override_config.moe_config.freeze_moe_router"]
    src = {}
    load_config(["critic.optim={lr: 1e-5}", "actor_rollout_ref.rollout.n=4"], sources=src)
    assert source_of(src, "critic.optim.lr") == "the command line"
    assert source_of(src, "critic.optim.betas") != "the command line"   # not set: the method's default applies
