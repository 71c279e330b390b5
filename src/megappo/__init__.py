"""megappo: a Megatron-backed, multi-node PPO trainer for LLMs with 3D parallelism.

Importing the package is cheap on purpose: torch, megatron-core, vLLM and Ray are imported by
the modules that use them, never here.
"""

__version__ = "0.1.0"
