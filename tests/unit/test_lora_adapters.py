"""LoRA's pure parts (megappo.models.lora): verl's module-name values, PEFT's names, and PEFT
adapter folders read and written (PEFT itself loads what megappo writes and computes the same).
The adapters on megatron models: tests/distributed/test_lora.py."""
import json

import pytest
import torch

from megappo.models import (LORA_MODULES, LoRAError, LoRASpec, lora_targets, peft_name, read_peft_adapter,
                            write_peft_adapter)
from tiny_models import VOCAB, save_tiny_model

ALL = list(LORA_MODULES)


def test_target_and_exclude_modules_in_verls_forms():
    assert lora_targets("all-linear") == ALL
    assert lora_targets(["all-linear"], "o_proj, down_proj") == ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
    assert lora_targets("v_proj,q_proj") == ["q_proj", "v_proj"]            # LORA_MODULES order
    assert lora_targets(["up_proj,gate_proj", "q_proj"]) == ["q_proj", "gate_proj", "up_proj"]
    assert lora_targets("all-linear", "all-linear") == []
    with pytest.raises(LoRAError, match=r"target_modules: unknown module name 'lm_head'; accepted: all-linear, q_proj"):
        lora_targets("q_proj,lm_head")
    with pytest.raises(LoRAError, match=r"exclude_modules: unknown module names 'linear_qkv', 'router'"):
        lora_targets("all-linear", ["linear_qkv", "router"])


def test_peft_names():
    assert peft_name(3, "q_proj", "A") == "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight"
    assert peft_name(0, "down_proj", "B") == "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"


def _peft_model(path, targets, seed):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=12, target_modules=targets, lora_dropout=0.0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"], ["gate_proj"]])
def test_peft_folder_round_trip(tmp_path, targets):
    """PEFT's save_pretrained -> read_peft_adapter: its spec and tensors; write_peft_adapter ->
    PeftModel.from_pretrained: the same adapters, the same logits."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    save_tiny_model("qwen3", tmp_path / "base")
    model = _peft_model(str(tmp_path / "base"), targets, seed=5)
    model.save_pretrained(str(tmp_path / "peft"))
    spec, tensors = read_peft_adapter(str(tmp_path / "peft"))
    want = ALL if targets == "all-linear" else targets
    assert (spec.rank, spec.alpha, spec.modules, spec.scaling) == (4, 12.0, tuple(want), 3.0)
    ref = get_peft_model_state_dict(model)
    assert tensors.keys() == ref.keys() == {peft_name(i, m, w) for i in range(4) for m in want for w in "AB"}
    for k in ref:
        assert torch.equal(tensors[k], ref[k]), k

    write_peft_adapter(str(tmp_path / "ours"), tensors, spec, base_model_name_or_path=str(tmp_path / "base"))
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(tmp_path / "ours")).eval()
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_unsupported_adapter_settings_are_named(tmp_path):
    save_tiny_model("qwen3", tmp_path / "base")
    _peft_model(str(tmp_path / "base"), ["q_proj"], seed=1).save_pretrained(str(tmp_path / "a"))
    cfg_file = tmp_path / "a" / "adapter_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(use_rslora=True, use_dora=True, rank_pattern={"q_proj": 8}, target_modules=["q_proj", "lm_head"])
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(LoRAError) as ei:
        read_peft_adapter(str(tmp_path / "a"))
    for part in ("use_rslora=True", "use_dora=True", "rank_pattern=", "unknown module name 'lm_head'"):
        assert part in str(ei.value)
    with pytest.raises(LoRAError, match="no adapter_model.safetensors"):
        (tmp_path / "a" / "adapter_model.safetensors").unlink()
        read_peft_adapter(str(tmp_path / "a"))
    with pytest.raises(LoRAError, match="not PEFT adapter names: model.layers.0.q_proj.weight"):
        write_peft_adapter(str(tmp_path / "b"), {"model.layers.0.q_proj.weight": torch.zeros(1)}, LoRASpec(1, 1, ("q_proj",)))


def test_spec_from_verls_keys(tmp_path):
    """A role's model section -> the adapters it asks for (what the trainer will build once LoRA
    is wired; validation refuses it until then, so these configs are loaded, not validated)."""
    from megappo.config import load_config
    from megappo.models import lora_spec_from_config

    cfg = load_config([], ["tiny_cpu"])
    assert lora_spec_from_config(cfg.actor_rollout_ref.model) is None and lora_spec_from_config(cfg.critic.model) is None
    cfg = load_config(["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=32",
                       "actor_rollout_ref.model.exclude_modules=[down_proj]", "critic.model.lora_rank=4",
                       "critic.model.target_modules=q_proj,v_proj"], ["tiny_cpu"])
    assert lora_spec_from_config(cfg.actor_rollout_ref.model) == LoRASpec(8, 32.0, tuple(ALL[:-1]))
    assert lora_spec_from_config(cfg.critic.model) == LoRASpec(4, 16.0, ("q_proj", "v_proj"))
    write_peft_adapter(str(tmp_path / "a"), {}, LoRASpec(2, 5, ("o_proj",)))
    cfg = load_config([f"actor_rollout_ref.model.lora_adapter_path={tmp_path}/a"], ["tiny_cpu"])
    assert lora_spec_from_config(cfg.actor_rollout_ref.model) == LoRASpec(2, 5.0, ("o_proj",))   # the folder's
