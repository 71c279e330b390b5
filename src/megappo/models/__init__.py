"""Megatron actor/reference/critic models built from HuggingFace configs."""
from .build import build_model, initialize_parallel
from .hf import (SUPPORTED_ARCHITECTURES, HFModelInfo, ModelDesc, ModelConfigError, MoEOptions, describe, load_hf_config,
                 padded_vocab_size, transformer_config)
from .layers import QKRMSNorm, RMSNorm, ValueHead, layer_spec, te_available, uses_te

__all__ = ["uses_te", "build_model", "initialize_parallel", "SUPPORTED_ARCHITECTURES", "HFModelInfo", "ModelDesc",
           "ModelConfigError", "MoEOptions", "describe", "load_hf_config", "padded_vocab_size", "transformer_config",
           "RMSNorm", "QKRMSNorm", "ValueHead", "layer_spec", "te_available"]
