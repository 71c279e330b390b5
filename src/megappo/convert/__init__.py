"""HF <-> megatron-core weight conversion: pure name maps on full tensors (names; the
tensor maps of the fused layouts are megappo.models.tensor_maps), TP split/gather (parallel), streaming load/export over a live model (hf_io, with
the shared-memory gather of shm), megatron shards in the rollout engine's own layout
(engine_layout), and megatron checkpoints to HF folders (megatron_ckpt, hf_export, the CLI)."""
from megappo.models import fuse_gate_up, fuse_qkv, pad_vocab, split_gate_up, split_qkv, unpad_vocab
from .names import ParamMap, full_shape, hf_shapes, param_maps, to_hf, to_megatron
from .parallel import to_global_name, to_local_name, tp_gather, tp_rows, tp_shard, tp_shard_shape
from .hf_io import (SafetensorsCheckpoint, WeightLoadError, gather_full, iter_hf_tensors, load_hf_weights, local_params,
                    plan_shared_gather)
from .live_export import live_hf_writer, write_live_hf
from .engine_layout import (ShardSyncPlan, SyncTensor, iter_sync_tensors, kernel_name, kernel_shard, layer_buckets,
                            plan_shard_sync)

__all__ = ["fuse_qkv", "split_qkv", "fuse_gate_up", "split_gate_up", "pad_vocab", "unpad_vocab",
           "ParamMap", "param_maps", "full_shape", "hf_shapes", "to_megatron", "to_hf", "tp_shard", "tp_gather",
           "tp_rows", "tp_shard_shape", "to_local_name", "to_global_name", "SafetensorsCheckpoint", "WeightLoadError",
           "gather_full", "iter_hf_tensors", "load_hf_weights", "local_params", "plan_shared_gather", "ShardSyncPlan",
           "SyncTensor", "iter_sync_tensors", "kernel_name", "kernel_shard", "layer_buckets", "plan_shard_sync",
           "live_hf_writer", "write_live_hf"]
