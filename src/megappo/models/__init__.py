"""Megatron actor/reference/critic models built from HuggingFace configs."""
from .build import build_model, initialize_parallel
from .hf import (SUPPORTED_ARCHITECTURES, HFModelInfo, ModelDesc, ModelConfigError, MoEOptions, describe, load_hf_config,
                 padded_vocab_size, transformer_config)
from .lora import (ATTENTION_MODULES, LORA_MODULES, LoRAError, LoRASpec, lora_spec_from_config, apply_lora, export_lora_tensors, load_lora_tensors,
                   lora_parameters, lora_targets, parse_lora_modules, peft_name, read_peft_adapter, set_lora_enabled,
                   write_peft_adapter, has_lora, lora_spec_of, merged_hf_tensors)
from .tensor_maps import fuse_gate_up, fuse_qkv, pad_vocab, qkv_group_views, split_gate_up, split_qkv, unpad_vocab
from .layers import QKRMSNorm, RMSNorm, SdpaCoreAttention, ValueHead, layer_spec, packs_sequences, te_available, uses_te
from .overrides import check_overrides, overridden_folder, override_problems
from .context_parallel import CPSequence, gather_positions, local_positions, natural_order, packed_local_positions

__all__ = ["check_overrides", "overridden_folder", "override_problems", "uses_te", "packs_sequences", "CPSequence", "local_positions", "gather_positions", "natural_order",
           "packed_local_positions", "build_model", "initialize_parallel", "SUPPORTED_ARCHITECTURES", "HFModelInfo", "ModelDesc",
           "ModelConfigError", "MoEOptions", "describe", "load_hf_config", "padded_vocab_size", "transformer_config",
           "RMSNorm", "QKRMSNorm", "SdpaCoreAttention", "ValueHead", "layer_spec", "te_available",
           "ATTENTION_MODULES", "LORA_MODULES", "LoRAError", "LoRASpec", "lora_spec_from_config", "apply_lora", "export_lora_tensors", "load_lora_tensors", "lora_parameters",
           "lora_targets", "parse_lora_modules", "peft_name", "set_lora_enabled", "read_peft_adapter", "write_peft_adapter",
           "has_lora", "lora_spec_of", "merged_hf_tensors", "fuse_qkv", "split_qkv", "fuse_gate_up",
           "split_gate_up", "pad_vocab", "unpad_vocab", "qkv_group_views"]
