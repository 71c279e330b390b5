"""Rollout with vLLM: the engine wrapper, weight sync from the actor, and the rollout replicas (which
ranks form one engine, which prompts it gets, the gather of their samples).

Importing this package does not import vLLM; constructing :class:`VLLMRollout` does.
"""
from .engine import RolloutOutput, SamplingConfig, VLLMRollout, layer_buckets, response_mask_from_ids
from .replicas import concat, gather_outputs, generate_replicated, prompt_slice, rollout_replica, rows_for_rank

__all__ = ["RolloutOutput", "SamplingConfig", "VLLMRollout", "layer_buckets", "response_mask_from_ids",
           "concat", "gather_outputs", "generate_replicated", "prompt_slice", "rollout_replica", "rows_for_rank"]
