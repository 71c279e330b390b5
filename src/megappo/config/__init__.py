"""Configuration: one dataclass tree whose key paths are verl's.

Values come, in order, from the dataclass defaults (verl's documented defaults where verl has
one, but for the few docs/configuration.md lists under "Where megappo differs from verl"), YAML presets (``--config FILE``, nested mappings or dotted keys) and command-line overrides
``a.b.c=value`` typed by the field's annotation. ``${a.b.c}`` refers to another key, as in verl's
YAML: a whole value (``critic.ppo_epochs=${actor_rollout_ref.actor.ppo_epochs}``) takes that key's
value and type; inside a string it is substituted as text.

- ``schema``: the tree, typed access by key path;
- ``parse``: presets, files and overrides, ``${}`` references, where each value came from;
- ``verl_keys``: verl keys that are not settings here (accepted, warned or refused, with a reason);
- ``validation``: every rule, one function per section, reported together, each naming its key;
- ``docs``: the reference table (``python -m megappo.config``).

Nothing here imports torch, vLLM, Ray or megatron except the lazy look-ups of the algorithm
registries during validation.
"""
from megappo.config.docs import config_reference_markdown
from megappo.config.parse import (GAE_GROUP_DEFAULTS, PRESETS_DIR, apply_mapping, apply_override, load_config, source_of, to_dict,
                                  to_yaml)
from megappo.config.schema import (ActorConfig, ActorRolloutRefConfig, AlgorithmConfig, ConfigError, CriticConfig,
                                   CriticModelConfig, CustomRewardFunctionConfig, DataConfig, KLCtrlConfig,
                                   MegatronConfig, ModelConfig, MultiTurnConfig, OptimConfig, PPOConfig, Ref, RefConfig,
                                   RefMegatronConfig, RewardModelConfig, RewardModelModelConfig, RolloutConfig,
                                   TrainerConfig, ValKwargsConfig, all_keys, get)
from megappo.config.validation import VLLM_ARGS_OWNED, critic_enabled, resumable_checkpoints, validate

__all__ = [
    "ConfigError",
    "Ref",
    "PPOConfig",
    "load_config",
    "validate",
    "apply_override",
    "apply_mapping",
    "to_dict",
    "to_yaml",
    "get",
    "all_keys",
    "config_reference_markdown",
    "critic_enabled",
    "resumable_checkpoints",
    "VLLM_ARGS_OWNED",
    "PRESETS_DIR",
    "source_of",
    "GAE_GROUP_DEFAULTS",
    "ActorConfig", "ActorRolloutRefConfig", "AlgorithmConfig", "CriticConfig", "CriticModelConfig",
    "CustomRewardFunctionConfig", "DataConfig", "KLCtrlConfig", "MegatronConfig", "ModelConfig", "MultiTurnConfig", "OptimConfig",
    "RefConfig", "RefMegatronConfig", "RewardModelConfig", "RewardModelModelConfig", "RolloutConfig", "TrainerConfig",
    "ValKwargsConfig",
]
