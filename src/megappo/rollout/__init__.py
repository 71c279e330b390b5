"""Rollout with vLLM: the engine wrapper (generation, sleep/wake, in-place weight loads) and the
rollout replicas (which ranks form one engine, which prompts it gets, the gather of their
samples). What the engine is sent, and when, is :mod:`megappo.sync`'s.

Importing this package does not import vLLM; constructing :class:`VLLMRollout` does.
"""
from .engine import (RolloutEngineError, RolloutOutput, SamplingConfig, VLLMRollout, engine_failure, layer_buckets,
                     response_mask_from_ids)
from .replicas import concat, gather_outputs, generate_replicated, prompt_slice, rollout_replica

__all__ = ["RolloutEngineError", "RolloutOutput", "SamplingConfig", "VLLMRollout", "engine_failure", "layer_buckets",
           "response_mask_from_ids",
           "concat", "gather_outputs", "generate_replicated", "prompt_slice", "rollout_replica"]
