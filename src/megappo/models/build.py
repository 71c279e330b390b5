"""Parallel state and model builders: actor/reference (GPTModel) and critic (value head)."""
from __future__ import annotations

from typing import Optional

import torch

from .hf import HFModelInfo
from .layers import ValueHead, layer_spec, te_available

__all__ = ["initialize_parallel", "build_model"]


def initialize_parallel(tp: int, pp: int, vpp: Optional[int] = None, seed: int = 42, ep: Optional[int] = None,
                        etp: int = 1, cp: int = 1) -> None:
    """megatron's parallel state for TP x CP x PP (x VPP); DP is what remains of the world. ``ep``
    (Mixture-of-Experts models only): experts over that many ranks; ``etp`` (expert-TP) must be 1:
    each expert stays whole on its EP rank. ``cp``: context parallelism (each sequence split over
    that many ranks, megappo.models.context_parallel). Seeds the model-parallel RNGs.
    torch.distributed must already be initialised."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    world = dist.get_world_size()
    if world % (tp * pp * cp):
        raise ValueError(f"world size {world} is not divisible by TP x CP x PP = {tp} x {cp} x {pp}")
    if etp != 1:
        raise ValueError(f"expert_tensor_parallel_size must be 1 (experts stay whole on their EP rank), got {etp}")
    if ep and (world // pp) % ep:
        raise ValueError(f"expert_model_parallel_size {ep} does not divide world size / PP = {world} / {pp}")
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    expert = dict(expert_model_parallel_size=ep, expert_tensor_parallel_size=1) if ep else {}
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp, **expert)
    model_parallel_cuda_manual_seed(seed)


def build_model(info: HFModelInfo, config, *, value_head: bool = False, use_te: Optional[bool] = None,
                seed: int = 42, value_head_std: float = 0.0, core_attention=None) -> list[torch.nn.Module]:
    """One GPTModel per virtual pipeline stage held by this rank (a list of one without VPP).

    ``value_head=True`` builds the critic: the same backbone, with a (1, hidden) head in place
    of the vocabulary output layer on the last stage and no weight tying. Weights are not
    initialised (load them, see megappo.convert.hf_io); the value head is (see ValueHead).
    ``core_attention``: see layer_spec (local spec only).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    desc = info.desc
    if desc.num_experts:
        _router_without_te()
    if value_head != desc.value_head:
        raise ValueError("build_model: value_head must match the description (describe(..., value_head=...))")
    if use_te is None:
        use_te = te_available()
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for i in range(vpp or 1):
        vp_stage = i if vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(
            config, layer_spec(config, desc.qk_layernorm, use_te, vp_stage=vp_stage,
                                     core_attention=core_attention), vocab_size=desc.padded_vocab_size,
            max_sequence_length=info.max_position_embeddings, pre_process=pre, post_process=post,
            parallel_output=True, share_embeddings_and_output_weights=desc.tie_word_embeddings and not value_head,
            position_embedding_type="rope", rotary_base=int(info.rope_theta), vp_stage=vp_stage)
        if not config.use_cpu_initialization:
            # Not every module creates its parameters on the device (MoE's router weight starts on
            # the CPU and megatron moves it at the first forward); megatron's own model builder
            # moves the whole model, as here: the workers need one device before their first pass.
            # (megappo's own value head, attached below, is made on the device itself.)
            model.cuda(torch.cuda.current_device())
        # RoPE frequencies exactly as transformers computes them (llama3/linear scaling included).
        rot = model.rotary_pos_emb
        rot.inv_freq = info.inv_freq.to(device=rot.inv_freq.device, dtype=rot.inv_freq.dtype)
        if value_head and post:
            model.output_layer = ValueHead(config, seed, std=value_head_std)
        model.megappo_te_spec = use_te  # parameter names follow the spec; hf_io reads this
        chunks.append(model)
    return chunks


def _router_without_te() -> None:
    """megatron-core 0.16.1 bug on any install without TransformerEngine: moe_utils defines
    ``te_general_gemm`` only when TE imports, but the router's matmul tests it for None
    (NameError). None is what "no TE" means there."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
