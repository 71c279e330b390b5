"""Router statistics of a Mixture-of-Experts training pass: the load-balancing and z-losses (as
megatron tracks them) and how evenly the routed tokens spread over the experts.

megatron never adds its router losses to the loss a schedule returns: it injects their gradient
in backward and records the unweighted values, per layer, in a module-level tracker. A pass
clears that tracker, counts the router calls that recorded into it, and reads it back as
megatron's own logging does (mean over micro-batches and MoE layers; TP partial sums added, DP
averaged, pipeline stages joined). The expert load comes from forward hooks on the routers: the
tokens each expert received, summed over all ranks, as max / mean and min / mean per layer,
averaged over layers (1.0 is a perfect balance; top-k routing of T tokens over E experts can
reach at most E / k).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["RouterStats", "TRACKED_LOSSES"]

# megatron's tracker names of the load-balancing loss, by moe_router_load_balancing_type
TRACKED_LOSSES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
                  "global_aux_loss": "global_load_balancing_loss"}


class RouterStats:
    """``with stats: <training passes>`` then ``stats.metrics()`` (collective over every rank).
    A no-op for dense models (``metrics()`` returns {})."""

    def __init__(self, chunks, config, device: torch.device):
        from megatron.core.transformer.moe.router import TopKRouter

        self.config, self.device = config, device
        self.routers = [m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)]
        self.enabled = bool(config.num_moe_experts)
        self.names = []
        if self.enabled:
            if config.moe_aux_loss_coeff and config.moe_router_load_balancing_type in TRACKED_LOSSES:
                self.names.append(TRACKED_LOSSES[config.moe_router_load_balancing_type])
            if config.moe_z_loss_coeff is not None:
                self.names.append("z_loss")
        self._hooks = []
        self.calls = 0
        self.load: Optional[torch.Tensor] = None

    def __enter__(self) -> "RouterStats":
        if not self.enabled:
            return self
        from megatron.core.transformer.moe import moe_utils

        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        moe_utils.clear_aux_losses_tracker()
        # Every rank needs every name before the reduction (a stage without MoE layers records
        # nothing, yet joins the pipeline all-reduce): create them as megatron's force_initialize does.
        for name in self.names:
            entry = tracker.setdefault(name, {"reduce_group": None, "avg_group": None, "reduce_group_has_dp": False})
            entry["values"] = torch.zeros(self.config.num_layers, device=self.device)
        self.calls = 0
        self.load = torch.zeros(self.config.num_layers, self.config.num_moe_experts, dtype=torch.float64,
                                device=self.device)
        first = self.routers[0] if self.routers else None

        def hook(router, _inputs, output):
            if not (router.training and torch.is_grad_enabled()):
                return        # forward-only passes record no losses: count neither
            if router is first:
                self.calls += 1   # one call per micro-batch (twice under full recomputation, as the losses)
            routing_map = output[1]
            self.load[router.layer_number - 1] += routing_map.sum(0).to(torch.float64)

        self._hooks = [r.register_forward_hook(hook) for r in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def metrics(self) -> dict[str, float]:
        """moe_aux_loss / moe_z_loss (unweighted, mean over micro-batches and MoE layers) and
        moe_expert_load_max / moe_expert_load_min; every rank must call it."""
        if not self.enabled:
            return {}
        from megatron.core.transformer.moe import moe_utils

        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        for name in self.names:   # this rank's mean over its micro-batches (their number differs with dynamic batches)
            tracker[name]["values"] /= max(self.calls, 1)
        moe_utils.reduce_aux_losses_tracker_across_ranks(self.names)
        if "z_loss" in self.names:
            # megatron records the z-loss with no reduce group: each rank's own tokens' mean (its
            # logging shows rank 0's); average it over the stage's TP x CP x DP ranks (equal token counts)
            from megatron.core import parallel_state as ps

            dist.all_reduce(tracker["z_loss"]["values"], op=dist.ReduceOp.AVG,
                            group=ps.get_tensor_and_data_parallel_group(with_context_parallel=True))
        n_moe = sum(self.config.moe_layer_freq) if isinstance(self.config.moe_layer_freq, list) else self.config.num_layers
        out = {}
        for name in self.names:
            key = "moe_z_loss" if name == "z_loss" else "moe_aux_loss"
            out[key] = tracker[name]["values"].sum().item() / n_moe
        moe_utils.clear_aux_losses_tracker()
        dist.all_reduce(self.load)   # every stage's layers, every rank's tokens
        layers = self.load[self.load.sum(-1) > 0]
        if len(layers):
            mean = layers.mean(-1, keepdim=True)
            out["moe_expert_load_max"] = (layers.max(-1, keepdim=True).values / mean).mean().item()
            out["moe_expert_load_min"] = (layers.min(-1, keepdim=True).values / mean).mean().item()
        return out
