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
def folder(tmp_path):
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


def test_the_folder_links_the_source_and_holds_the_merged_config(folder):
    from megappo.models import overridden_folder

    assert overridden_folder(folder, {}) == folder
    out = overridden_folder(folder, {"max_position_embeddings": 2048})
    assert out != folder and overridden_folder(folder, {"max_position_embeddings": 2048}) == out   # made once
    assert sorted(os.listdir(out)) == ["config.json", "sub", "tokenizer.json"]
    assert os.path.islink(os.path.join(out, "tokenizer.json")) and not os.path.islink(os.path.join(out, "config.json"))
    assert open(os.path.join(out, "sub", "x.bin"), "rb").read() == b"1234"
    assert json.load(open(os.path.join(out, "config.json")))["max_position_embeddings"] == 2048
    assert json.load(open(os.path.join(folder, "config.json"))) == QWEN
    assert overridden_folder(folder, {"max_position_embeddings": 4096}) != out


def test_the_folder_is_removed_at_exit_and_the_source_kept(folder):
    code = ("from megappo.models import overridden_folder\n"
            f"print(overridden_folder({folder!r}, {{'rms_norm_eps': 1e-5}}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out.startswith("/") and not os.path.exists(out)
    assert sorted(os.listdir(folder)) == ["config.json", "sub", "tokenizer.json"]
    assert open(os.path.join(folder, "sub", "x.bin"), "rb").read() == b"1234"


def test_check_reads_the_merged_config_through_transformers(folder):
    from megappo.models import check_overrides

    c = check_overrides(folder, {"rope_theta": 500.0, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5})
    assert c.rope_parameters["rope_theta"] == 500.0 and c.max_position_embeddings == 4096 and c.rms_norm_eps == 1e-5
    c = check_overrides(folder, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert c.rope_parameters["rope_type"] == "linear" and c.rope_parameters["factor"] == 2.0


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
