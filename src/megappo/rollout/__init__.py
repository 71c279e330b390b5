"""Rollout with vLLM: the engine wrapper (generation, sleep/wake, in-place weight loads) and the
rollout replicas (which ranks form one engine, which prompts it gets, the gather of their
samples), and multi-turn generation with tools over a small engine protocol. What the engine is sent, and when, is :mod:`megappo.sync`'s.

Importing this package does not import vLLM; constructing :class:`VLLMRollout` does.
"""
from .engine import (VLLM_MAX_LORA_RANK, RolloutEngineError, RolloutOutput, SamplingConfig, VLLMRollout, engine_failure,
                     layer_buckets, response_mask_from_ids, vllm_engine_kwargs, vllm_lora_rank)
from .multi_turn import (MultiTurnSample, ToolTurnTokens, TurnEngine, VLLMTurns, loop_settings, multi_turn_generate,
                         sample_metrics, tool_runner)
from .replicas import concat, gather_outputs, generate_replicated, prompt_slice, rollout_replica

__all__ = ["RolloutEngineError", "RolloutOutput", "SamplingConfig", "VLLMRollout", "engine_failure", "layer_buckets",
           "response_mask_from_ids", "VLLM_MAX_LORA_RANK", "vllm_lora_rank", "vllm_engine_kwargs",
           "MultiTurnSample", "ToolTurnTokens", "TurnEngine", "VLLMTurns", "loop_settings", "multi_turn_generate", "sample_metrics",
           "tool_runner",
           "concat", "gather_outputs", "generate_replicated", "prompt_slice", "rollout_replica"]
