"""Parallel-aware pieces: each process's device and host-side DP group, vocabulary-parallel
log-prob/entropy (TP), and the split placement's groups and bridge (``split``). DP-global
statistics live with the math in :mod:`megappo.algo` (their ``group=``/``dp_group=`` arguments);
the rank layout itself is :mod:`megappo.layout`.

Process groups are always arguments; nothing here reads megatron's global parallel state.
"""
from . import split
from .device import host_dp_group, host_world_group, module_device, process_device
from .vocab_parallel import (LOGITS_CHUNK_TOKENS, entropy_from_vocab_parallel_logits, log_probs_and_entropy,
                             log_probs_from_logits, log_probs_reference, sum_pi_squared_from_vocab_parallel_logits)

__all__ = ["split", "process_device", "module_device", "host_dp_group", "host_world_group", "log_probs_from_logits", "entropy_from_vocab_parallel_logits", "log_probs_reference",
           "log_probs_and_entropy", "sum_pi_squared_from_vocab_parallel_logits", "LOGITS_CHUNK_TOKENS"]
