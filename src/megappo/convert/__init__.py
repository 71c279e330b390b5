"""HF <-> megatron-core weight conversion: pure name and tensor maps on full tensors (names,
tensor_maps), TP/PP placement (parallel), and streaming load/export over a live model (hf_io)."""
from .tensor_maps import fuse_gate_up, fuse_qkv, pad_vocab, split_gate_up, split_qkv, unpad_vocab
from .names import ModelDesc, ParamMap, full_shape, hf_shapes, param_maps, to_hf, to_megatron
from .parallel import (global_layer, layer_owner, layers_per_chunk, to_global_name, to_local_name, tp_gather, tp_rows,
                       tp_shard)

__all__ = ["fuse_qkv", "split_qkv", "fuse_gate_up", "split_gate_up", "pad_vocab", "unpad_vocab", "ModelDesc",
           "ParamMap", "param_maps", "full_shape", "hf_shapes", "to_megatron", "to_hf", "tp_shard", "tp_gather",
           "tp_rows", "layers_per_chunk", "layer_owner", "global_layer", "to_local_name", "to_global_name"]
