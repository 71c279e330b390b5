"""Actor and Critic: forward-only and training passes through megatron's pipeline schedules.

Loss normalisation: every micro-batch's loss uses the mini-batch's GLOBAL token/sequence counts
(megappo.algo.agg_loss), so the micro-batch losses of all DP ranks add up to the mini-batch loss.
megatron's schedule divides each micro-batch loss by the number of micro-batches and its DDP
averages gradients over DP; the loss handed to backward is multiplied by both so that the
gradient is exactly that of the mini-batch loss, whatever the split.

Data-parallel layout: a rank's k-th mini-batch is its part of the global k-th mini-batch (the
trainer deals samples out per mini-batch), as in verl.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch
import torch.distributed as dist

from megappo import algo, seeds
from megappo.batch import RolloutBatch
from megappo.distributed import (log_probs_and_entropy, log_probs_from_logits, module_device,
                                 sum_pi_squared_from_vocab_parallel_logits)
from megappo.models import CPSequence, local_positions

from .batching import fit_to_multiple, micro_batch_groups
from .moe_stats import RouterStats
from .offload import StateOffload
from .packing import Packed, pack

__all__ = ["MegatronWorker", "Actor", "AdaptersOff", "Critic"]


def _scaled(result, scale: float):
    loss, metrics = result
    return loss * scale, metrics


def _pad_seq(ids: torch.Tensor, multiple: int, pad: int) -> torch.Tensor:
    S = ids.shape[1]
    target = -(-S // multiple) * multiple
    return ids if target == S else torch.nn.functional.pad(ids, (0, target - S), value=pad)


class MegatronWorker:
    """Model chunks (one per VPP stage) + optional DDP and megatron optimizer.

    Devices: the worker computes on ``device`` (default: where its parameters are; every parameter
    must be there). Batches arrive on the host; each micro-batch is moved to the device at the
    schedule's boundary, collectives over megatron's groups (NCCL on GPU) carry device tensors,
    and per-sample results go back to the host."""

    def __init__(self, chunks, config, *, device=None, lr: Optional[float] = None, weight_decay: float = 0.0,
                 clip_grad: float = 1.0, betas=(0.9, 0.999), use_distributed_optimizer: bool = True,
                 pad_token_id: int = 0, optimizer: str = "adam", lr_warmup_steps: int = 0,
                 lr_decay_steps: Optional[int] = None, lr_decay_style: str = "constant", min_lr: float = 0.0):
        from megatron.core import parallel_state as ps

        self.config = config
        self.pad_token_id = pad_token_id
        self.desc = None   # the model's ModelDesc, set by megappo.builders (a checkpoint's HF export names tensors by it)
        self.device = module_device(chunks)
        if device is not None and torch.device(device) != self.device:
            raise ValueError(f"the model's parameters are on {self.device}, not on the worker's device {device}")
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.dp_group = ps.get_data_parallel_group()
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.dp = ps.get_data_parallel_world_size()
        # Context parallelism: the CP ranks of a DP rank share its rows, each holding part of
        # every sequence (megappo.models.context_parallel); DDP reduces over DP x CP.
        self.cp = ps.get_context_parallel_world_size()
        self.cp_group = ps.get_context_parallel_group() if self.cp > 1 else None
        self.is_last = ps.is_pipeline_last_stage()
        self.last_rank = dist.get_global_rank(self.pp_group, self.pp - 1)
        self.optimizer = None
        # What megatron's schedule runs: the chunks in DDP wrappers when training, the chunks
        # themselves when forward-only. ``self.chunks`` are always the bare modules (weight export).
        self.ddp_chunks = list(chunks)
        if lr is not None:
            from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                                   finalize_model_grads)
            from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

            ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=use_distributed_optimizer,
                                                    grad_reduce_in_fp32=True)
            self.ddp_chunks = [DistributedDataParallel(config, ddp_cfg, c) for c in chunks]
            config.finalize_model_grads_func = finalize_model_grads
            self.optimizer = get_megatron_optimizer(
                OptimizerConfig(optimizer=optimizer, lr=lr, min_lr=min_lr, weight_decay=weight_decay, clip_grad=clip_grad,
                                adam_beta1=betas[0], adam_beta2=betas[1], bf16=config.bf16, fp16=config.fp16,
                                params_dtype=config.params_dtype, use_distributed_optimizer=use_distributed_optimizer),
                self.ddp_chunks)
            _use_foreach(self.optimizer)
            # Stepped once per PPO step (update_policy / update_critic call), as verl does: linear
            # warm-up from 0 over lr_warmup_steps, then constant / linear / cosine to min_lr.
            from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

            decay = max(lr_decay_steps or 0, lr_warmup_steps + 1)
            self.scheduler = OptimizerParamScheduler(
                self.optimizer, init_lr=0.0 if lr_warmup_steps > 0 else lr, max_lr=lr, min_lr=min_lr,
                lr_warmup_steps=lr_warmup_steps, lr_decay_steps=decay, lr_decay_style=lr_decay_style,
                start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=decay, wd_incr_style="constant")
        self.chunks = list(chunks)
        self.state_offload = StateOffload(self)   # nothing offloaded unless set_offload() says so
        # Sequence packing (THD): only with TransformerEngine's layer spec (builders decide)
        self.pack_sequences = False

    def set_offload(self, *, params: bool = False, grads: bool = False, optimizer: bool = False) -> None:
        """What to move off the device while idle (megatron.param_offload/grad_offload/
        optimizer_offload); :meth:`offload` moves it, every pass brings back what it uses."""
        self.state_offload.reload_all()
        self.state_offload = StateOffload(self, params=params, grads=grads, optimizer=optimizer)

    def offload(self, *, params: bool = True) -> None:
        """Free what set_offload selected (between this worker's passes); ``params=False`` keeps
        the weights (gradients and optimizer state only)."""
        self.state_offload.offload(params=params)

    # -- schedule ---------------------------------------------------------------------------
    def _run(self, micro_batches: list[RolloutBatch], loss_fn, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        pad = (self.tp if self.config.sequence_parallel else 1) * (2 * self.cp if self.cp > 1 else 1)
        if self.pack_sequences:
            seqs = self._pack(micro_batches, pad)
        else:
            seqs = [_pad_seq(mb.input_ids, pad, self.pad_token_id) for mb in micro_batches]
        data = list(zip(micro_batches, seqs))

        def forward_step(data_iterator, model):
            mb, ids = self._to_device(*next(data_iterator))
            if isinstance(ids, Packed):
                if self.cp > 1:   # each sequence's two chunks of this rank; the bounds stay the row's
                    ids = ids.on_cp_rank(self.cp_group)
                out = model(ids.local(ids.ids), ids.local(ids.position_ids), attention_mask=None,
                            packed_seq_params=ids.params())
            elif self.cp > 1:
                held = local_positions(ids.shape[1], self.cp, self.cp_group.rank(), device=ids.device)
                ids = CPSequence(ids, self.cp_group, held, self.pad_token_id)
                out = model(ids.local_ids, held[None].expand(ids.ids.shape[0], -1), attention_mask=None)
            else:
                pos = torch.arange(ids.shape[1], device=ids.device)[None].expand_as(ids)
                out = model(ids, pos, attention_mask=None)
            return out, partial(loss_fn, mb, ids)

        its = [iter(data) for _ in self.ddp_chunks] if len(self.ddp_chunks) > 1 else iter(data)
        width = [s.ids.shape[1] if isinstance(s, Packed) else s.shape[1] for s in seqs]
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=its,
            model=self.ddp_chunks if len(self.ddp_chunks) > 1 else self.ddp_chunks[0], num_microbatches=len(data),
            seq_length=max(width), micro_batch_size=1 if self.pack_sequences else micro_batches[0].input_ids.shape[0],
            forward_only=forward_only)

    def _pack(self, micro_batches: list[RolloutBatch], align: int) -> list[Packed]:
        """Each micro-batch as one packed row; under VPP all of one length (one p2p shape)."""
        lengths = [(mb.prompt_lengths + mb.response_lengths).clamp(min=1).tolist() for mb in micro_batches]
        packs = [pack(mb.input_ids, n, self.pad_token_id, align) for mb, n in zip(micro_batches, lengths)]
        if len(self.ddp_chunks) > 1:
            total = max(p.ids.shape[1] for p in packs)
            packs = [pack(mb.input_ids, n, self.pad_token_id, align, total=total) for mb, n in zip(micro_batches, lengths)]
        return packs

    @staticmethod
    def _next_token(output: torch.Tensor, ids):
        """(logits, labels, to_rows) of next-token prediction: the padded layout's positions
        0..S-2, or every packed position, with ``to_rows`` mapping per-position values back to
        the padded (B, S-1) layout."""
        if isinstance(ids, Packed):   # under CP this rank's positions; gather() joins the row
            return output, ids.local(ids.next_ids), lambda x: ids.rows(ids.gather(x), ids.width - 1)
        if isinstance(ids, CPSequence):   # this rank's positions; rows() gathers the whole sequence
            return output, ids.next_ids(), lambda x: ids.gather(x)[:, :-1]
        return output[:, :-1], ids[:, 1:], lambda x: x

    def _to_device(self, mb: RolloutBatch, ids: torch.Tensor) -> tuple[RolloutBatch, torch.Tensor]:
        """The worker boundary: one micro-batch on the device at a time (its loss closure keeps
        it until backward)."""
        return mb.to(self.device, non_blocking=True), ids.to(self.device, non_blocking=True)

    def _micro(self, batch: RolloutBatch, micro_batch_size, max_token_len):
        """Micro-batches, the order of their real rows in ``batch`` and each one's real row count.

        Each micro-batch is cut to its own longest sequence: a token budget bounds count x
        longest, and the batch's full width would exceed it. The interleaved (VPP) schedule
        needs a multiple of PP micro-batches (at least PP) and, on its p2p path, one shape for
        all of them (models.transformer_config turns variable shapes off): the heaviest groups
        are split (fit_to_multiple), then every micro-batch is filled up to the same row count
        with copies of the shortest sample under an all-zero response mask (no loss, no
        gradient; their outputs are dropped) and kept at the batch's width."""
        lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
        if max_token_len is not None:   # a budget per GPU: each CP rank holds 1/CP of the micro-batch (as verl)
            max_token_len *= self.cp
        groups = micro_batch_groups(len(batch), lengths, micro_batch_size, max_token_len)
        vpp = len(self.ddp_chunks) > 1
        if vpp:
            groups = fit_to_multiple(groups, lengths, self.pp)
            rows = max(len(g) for g in groups)
            filler = min(range(len(batch)), key=lambda i: lengths[i])
        micros = []
        for g in groups:
            if vpp:
                mb = batch.select(g + [filler] * (rows - len(g)))
                mb.response_mask[len(g):] = 0
            else:
                mb = batch.select(g)
                mb.input_ids = mb.input_ids[:, :min(batch.input_ids.shape[1], max(2, max(lengths[i] for i in g)))]
            micros.append(mb)
        return micros, [i for g in groups for i in g], [len(g) for g in groups]

    def _gather_rows(self, outs, key, order, keep, shape) -> torch.Tensor:
        """Concatenate per-micro-batch outputs (last stage) back into batch order, on every
        stage, on the host. Only the first ``keep[i]`` rows of micro-batch i are real."""
        t = None
        if self.is_last:
            cat = torch.cat([o[key][:k] for o, k in zip(outs, keep)])
            t = torch.empty_like(cat)
            t[torch.tensor(order)] = cat
        return self._from_last_stage(t, shape).cpu()

    @torch.no_grad()
    def _forward(self, batch: RolloutBatch, micro_batch_size, max_token_len, per_sample, k: int = 0) -> torch.Tensor:
        """(B, T) ``per_sample(output, ids, mb)`` for every sample, in batch order, on every rank
        ((B, k, T) when ``per_sample`` stacks ``k`` such quantities)."""
        def loss_fn(mb, ids, output):
            out = per_sample(output, ids, mb)
            return out.sum() * 0.0, {"out": out}

        micros, order, keep = self._micro(batch, micro_batch_size, max_token_len)
        self.state_offload.ensure(params=True)
        outs = self._run(micros, loss_fn, forward_only=True)
        B, T = batch.responses.shape
        return self._gather_rows(outs, "out", order, keep, (B, k, T) if k else (B, T))

    def _train(self, batch: RolloutBatch, *, mini_batch_size, micro_batch_size, max_token_len, ppo_epochs,
               make_loss, keys, prepare=None, shuffle_seed: Optional[int] = None) -> dict[str, list]:
        """``ppo_epochs`` x this rank's mini-batches, one optimizer step each; with ``shuffle_seed``
        each epoch splits a new random order of the rows (seeds.epoch_order), else the batch as it is.

        ``make_loss(norm)`` returns the micro-batch loss function given the mini-batch's global
        normalisers; its metric dict holds micro-batch parts that add up (over micro-batches and
        DP ranks) to the mini-batch value of each of ``keys``. ``prepare(mini, seed)``, when given,
        may add fields to each mini-batch before its micro-batches run (``seed``: distinct per
        mini-batch of the run, equal on every rank)."""
        self.state_offload.ensure(params=True, grads=True, optimizer=True)
        history = {k: [] for k in (*keys, "grad_norm")}
        history["lr"] = [self.optimizer.param_groups[0]["lr"]]
        router = RouterStats(self.chunks, self.config, self.device)   # MoE: router losses and expert load
        with router:
            self._epochs(batch, history, mini_batch_size, micro_batch_size, max_token_len, ppo_epochs, make_loss, keys,
                         prepare, shuffle_seed)
        history.update({k: [v] for k, v in router.metrics().items()})
        self.scheduler.step(increment=1)
        return history

    def _epochs(self, batch, history, mini_batch_size, micro_batch_size, max_token_len, ppo_epochs, make_loss, keys,
                prepare, shuffle_seed) -> None:
        # the scheduler's step count survives a resume: so do the orders and the mini-batch seeds
        steps = int(self.scheduler.num_steps)
        for epoch in range(ppo_epochs):
            rows = batch if shuffle_seed is None else batch.select(
                seeds.epoch_order(len(batch), shuffle_seed, steps, epoch).to(batch.responses.device))
            for i, mini in enumerate(rows.split(mini_batch_size)):
                if prepare is not None:
                    mini = prepare(mini, seeds.mini_batch_seed(steps, epoch, i))
                mask = mini.loss_mask.to(self.device)
                norm = dict(global_tokens=algo.global_count(mask, self.dp_group),
                            global_seqs=algo.global_seq_count(mask, self.dp_group))
                micros = self._micro(mini, micro_batch_size, max_token_len)[0]
                # cancels megatron's 1/num_microbatches and its DDP's averaging over DP (and over CP,
                # which megatron's schedule cancels itself: the CP ranks' gradients are parts of one
                # gradient, each from the rank's own positions)
                scale = len(micros) * self.dp
                loss_fn = make_loss(norm)
                self._zero_grad()
                outs = self._run(micros, lambda mb, ids, output: _scaled(loss_fn(mb, ids, output), scale),
                                 forward_only=False)
                grad_norm, _ = self._step()
                local = [float(sum(o[key] for o in outs)) if self.is_last else 0.0 for key in keys]
                for key, total in zip(keys, self._global_sums(local)):
                    history[key].append(total)
                history["grad_norm"].append(grad_norm)

    def _from_last_stage(self, t: Optional[torch.Tensor], shape, dtype=torch.float32) -> torch.Tensor:
        """A tensor computed on the last pipeline stage, on every stage."""
        if self.pp == 1:
            return t
        buf = t.contiguous() if self.is_last else torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(buf, src=self.last_rank, group=self.pp_group)
        return buf

    def _global_sums(self, xs: list[float]) -> list[float]:
        """Each of the last stage's per-rank figures summed over DP, on every stage: one
        all-reduce for all of them (one per figure cost a mini-batch ~2% of a tiny model's step)."""
        t = torch.tensor(xs, dtype=torch.float64, device=self.device)
        if self.is_last:
            dist.all_reduce(t, group=self.dp_group)
        return self._from_last_stage(t, (len(xs),), torch.float64).tolist()

    def _step(self) -> tuple[float, bool]:
        ok, grad_norm, _ = self.optimizer.step()
        return (float(grad_norm) if grad_norm is not None else 0.0), bool(ok)

    def _zero_grad(self) -> None:
        for m in self.ddp_chunks:
            m.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _response_gather(self, per_position: torch.Tensor, mb: RolloutBatch) -> torch.Tensor:
        """(B, S-1) next-token quantities -> (B, T) at the response tokens, 0 where masked."""
        idx = mb.response_positions.clamp(max=per_position.shape[1] - 1)
        return per_position.gather(1, idx) * mb.response_mask


class Actor(MegatronWorker):
    """Policy (or, without an optimizer, the frozen reference)."""

    def __init__(self, chunks, config, *, vocab_size: int, **kw):
        super().__init__(chunks, config, **kw)
        self.vocab_size = vocab_size

    def _log_probs(self, output, ids, mb, with_entropy: bool):
        logits, labels, rows = self._next_token(output, ids)
        if not with_entropy:
            lp = log_probs_from_logits(logits, labels, self.tp_group, self.vocab_size)
            return self._response_gather(rows(lp), mb), None
        lp, ent = log_probs_and_entropy(logits, labels, self.tp_group, self.vocab_size)
        return self._response_gather(rows(lp), mb), self._response_gather(rows(ent), mb)

    def compute_log_prob(self, batch: RolloutBatch, micro_batch_size: Optional[int] = None,
                         max_token_len: Optional[int] = None, with_sum_pi_squared: bool = False):
        """(B, T) log-probs of the response tokens under the current weights, on every rank.
        Micro-batches: ``micro_batch_size`` samples, or a ``max_token_len`` budget.
        ``with_sum_pi_squared``: also sum_v pi_v^2 at each response token, from the same logits
        (optimal_token_baseline's input); returns (log-probs, sum pi^2) then."""
        if not with_sum_pi_squared:
            return self._forward(batch, micro_batch_size, max_token_len,
                                 lambda output, ids, mb: self._log_probs(output, ids, mb, with_entropy=False)[0])

        def both(output, ids, mb):
            logits, labels, rows = self._next_token(output, ids)
            lp = log_probs_from_logits(logits, labels, self.tp_group, self.vocab_size)
            spq = sum_pi_squared_from_vocab_parallel_logits(logits, self.tp_group, self.vocab_size)
            return torch.stack([self._response_gather(rows(lp), mb), self._response_gather(rows(spq), mb)], dim=1)

        out = self._forward(batch, micro_batch_size, max_token_len, both, k=2)
        return out[:, 0], out[:, 1]

    def update_policy(self, batch: RolloutBatch, *, mini_batch_size: int, micro_batch_size: Optional[int] = None,
                      max_token_len: Optional[int] = None, ppo_epochs: int = 1,
                      loss: algo.PolicyLossSpec = algo.PolicyLossSpec(), shuffle_seed: Optional[int] = None) -> dict:
        """PPO epochs over this rank's mini-batches (``mini_batch_size`` samples per rank).
        Returns per-mini-batch global losses and verl-named averages."""
        def make_loss(norm):
            norm = dict(norm, norm_factor=loss.norm_factor)

            def loss_fn(mb, ids, output):
                lp, ent = self._log_probs(output, ids, mb, with_entropy=True)
                pg_mask = mb.loss_mask
                if loss.bypass_rejection is not None:
                    # bypass mode: the old log-probs are the engine's; reject against the current policy
                    # (as verl's bypass loss), on the policy term only, normalisers unchanged
                    rs, threshold = loss.bypass_rejection
                    keep, _ = algo.rollout_rejection_mask(lp.detach(), mb.old_log_prob, pg_mask, rs=rs,
                                                          threshold=threshold)
                    pg_mask = pg_mask * keep.to(pg_mask.dtype)
                pg, m = algo.compute_policy_loss(loss.loss_mode, mb.old_log_prob, lp, mb.advantages, pg_mask,
                                                 rollout_is_weights=mb.rollout_is_weights,
                                                 cov_selected=mb.cov_selected, **loss.loss_kwargs(), **norm)
                ent_loss = algo.agg_loss(ent, mb.loss_mask, loss.loss_agg_mode, **norm)
                # at entropy_coeff 0 the entropy is a metric: left out of the loss, it gets no
                # gradient pass (its terms were zeros: the same gradient)
                total = pg - loss.entropy_coeff * ent_loss if loss.entropy_coeff else pg
                kl = torch.zeros((), device=lp.device)
                if loss.use_kl_loss:
                    kl = algo.agg_loss(algo.kl_penalty(lp, mb.ref_log_prob, loss.kl_loss_type), mb.loss_mask,
                                       loss.loss_agg_mode, **norm)
                    total = total + loss.kl_loss_coef * kl
                share = mb.loss_mask.sum() / norm["global_tokens"]  # token share, for token-mean metrics
                return total, {"pg_loss": pg.detach(), "kl_loss": kl.detach(), "entropy": ent_loss.detach(),
                               **{k: v * share for k, v in m.items()}}
            return loss_fn

        cov_share = []   # per mini-batch: the share of its tokens Clip-Cov / KL-Cov selected

        def select_cov_tokens(mini: RolloutBatch, seed: int) -> RolloutBatch:
            """Clip-Cov/KL-Cov choose their tokens over the whole mini-batch, from the current
            policy's log-probs (one forward pass more per mini-batch), before its micro-batches."""
            lp = self.compute_log_prob(mini, micro_batch_size, max_token_len).to(self.device)
            if mini.sample_index is None:
                raise ValueError(f"loss_mode={loss.loss_mode} needs each sample's sample_index (set when the "
                                 "trainer deals the batch)")
            keys = algo.token_keys(mini.sample_index.to(self.device), lp.shape[1], seed)
            on = {k: getattr(mini, k).to(self.device) for k in ("old_log_prob", "advantages", "loss_mask")}
            if loss.loss_mode == "clip_cov":
                sel = algo.clip_cov_selection(on["old_log_prob"], lp, on["advantages"], on["loss_mask"], keys,
                                              dp_group=self.dp_group, **loss.clip_cov_kwargs())
            else:
                sel = algo.kl_cov_selection(lp, on["advantages"], on["loss_mask"], keys, dp_group=self.dp_group,
                                            kl_cov_ratio=loss.kl_cov_ratio)
            mini.cov_selected = sel.to(mini.response_mask.device)
            # a name of megappo's own: verl logs no such share for KL-Cov (for Clip-Cov it is pg_clipfrac)
            cov_share.append(float(algo.global_count(sel, self.dp_group)
                                   / algo.global_count(on["loss_mask"], self.dp_group).clamp(min=1)))
            return mini

        history = self._train(batch, mini_batch_size=mini_batch_size, micro_batch_size=micro_batch_size,
                              max_token_len=max_token_len, ppo_epochs=ppo_epochs, make_loss=make_loss,
                              keys=("pg_loss", "kl_loss", "entropy", "pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"),
                              prepare=select_cov_tokens if loss.loss_mode in algo.COV_LOSSES else None,
                              shuffle_seed=shuffle_seed)
        metrics = {f"actor/{k}": sum(v) / len(v) for k, v in history.items() if v}
        metrics["actor/pg_loss_per_minibatch"] = history["pg_loss"]
        if cov_share:
            metrics["actor/cov_selected_fraction"] = sum(cov_share) / len(cov_share)
        return metrics


class AdaptersOff:
    """The reference policy of a LoRA actor: the actor's own frozen base, its adapters switched
    off for the pass (no second copy of the weights; megappo.models.lora). Forward-only: it has
    the reference's interface (log-probs, offload) and nothing to train."""

    def __init__(self, actor: Actor):
        self.actor = actor
        self.chunks = actor.chunks

    def compute_log_prob(self, batch: RolloutBatch, **kwargs):
        from megappo.models import set_lora_enabled

        set_lora_enabled(self.chunks, False)
        try:
            return self.actor.compute_log_prob(batch, **kwargs)
        finally:
            set_lora_enabled(self.chunks, True)

    def offload(self, *, params: bool = True) -> None:
        """The weights are the actor's: they leave the device as the actor's offload settings say."""
        self.actor.offload(params=params)


class Critic(MegatronWorker):
    """Value model: a GPTModel whose output layer is megappo.models.ValueHead.

    ``value_mode`` (critic.value_mode): how the head's outputs become V(s_t), the value of the
    state before response token t. ``state``: the output at the token before t (verl's critic).
    ``increments``: V(s_0) from the last prompt token plus the running sum of the outputs at every
    response token before t, each read where that token is the newest one in view: the head emits
    each token's change of value, so a token's own credit is a feature of that token (is it the
    word the prompt asked for?) instead of a count the network must keep over the prefix. Both
    can express any value function of the prefix; they learn differently."""

    def __init__(self, chunks, config, *, value_mode: str = "state", **kw):
        super().__init__(chunks, config, **kw)
        if value_mode not in ("state", "increments"):
            raise ValueError(f"critic.value_mode: {value_mode!r}; expected 'state' or 'increments'")
        self.value_mode = value_mode

    def _values(self, output, ids, mb) -> torch.Tensor:
        per_position, _, rows = self._next_token(output[..., 0].float(), ids)
        if self.value_mode == "state":
            return self._response_gather(rows(per_position), mb)
        per_position = rows(per_position)
        # every position of the response region adds its increment (a tool turn's tokens too: the
        # state after them includes them); padding adds nothing
        idx = mb.response_positions.clamp(max=per_position.shape[1] - 1)
        increments = per_position.gather(1, idx) * mb.valid_mask.to(per_position.dtype)
        return increments.cumsum(-1) * mb.response_mask

    def compute_values(self, batch: RolloutBatch, micro_batch_size: Optional[int] = None,
                       max_token_len: Optional[int] = None) -> torch.Tensor:
        return self._forward(batch, micro_batch_size, max_token_len, lambda output, ids, mb: self._values(output, ids, mb))

    def update_critic(self, batch: RolloutBatch, *, mini_batch_size: int, micro_batch_size: Optional[int] = None,
                      max_token_len: Optional[int] = None, ppo_epochs: int = 1,
                      loss: algo.ValueLossSpec = algo.ValueLossSpec(), shuffle_seed: Optional[int] = None) -> dict:
        def make_loss(norm):
            def loss_fn(mb, ids, output):
                vf, clipfrac = algo.value_loss(self._values(output, ids, mb), mb.returns, mb.values, mb.loss_mask,
                                               cliprange_value=loss.cliprange_value, loss_agg_mode=loss.loss_agg_mode,
                                               norm_factor=loss.norm_factor, **norm)
                share = mb.loss_mask.sum() / norm["global_tokens"]
                return vf, {"vf_loss": vf.detach(), "vf_clipfrac": clipfrac * share}
            return loss_fn

        history = self._train(batch, mini_batch_size=mini_batch_size, micro_batch_size=micro_batch_size,
                              max_token_len=max_token_len, ppo_epochs=ppo_epochs, make_loss=make_loss,
                              keys=("vf_loss", "vf_clipfrac"), shuffle_seed=shuffle_seed)
        metrics = {f"critic/{k}": sum(v) / len(v) for k, v in history.items() if v}
        metrics["critic/vf_loss_per_minibatch"] = history["vf_loss"]
        return metrics


class RewardModel(Critic):
    """Outcome reward model: a critic-style scalar head read at the last token of each response
    (verl's convention for megatron reward models), forward only.

    With tool turns (multi-turn) it reads the whole conversation as the policy saw it, the exact
    token ids (prompt, model turns, tool turns; no re-rendering), and scores at the last *model*
    token: there causal attention has seen everything before it, and the score lands on an action
    the policy took (a score on a tool token would be outside the response mask every advantage
    reads). megappo's turn loop always ends a conversation with a model turn, so this is the last
    token of the sequence, where verl's megatron reward model reads it too."""

    def compute_scores(self, batch: RolloutBatch, micro_batch_size: Optional[int] = None,
                       max_token_len: Optional[int] = None) -> torch.Tensor:
        """(B, T) token-level scores: the model's output at each response's last model token
        (``response_mask``), placed on that token; zero elsewhere (and for empty responses)."""
        def per_sample(output, ids, mb):
            mask = mb.response_mask
            # the last model token's index: with tool turns the mask has gaps, so its sum is no position
            idx = torch.arange(mask.shape[1], device=mask.device)
            end = torch.where(mask > 0, idx, -1).amax(-1)
            per_position = output[..., 0].float()
            if isinstance(ids, Packed):
                per_position = ids.rows(ids.gather(per_position))
            elif isinstance(ids, CPSequence):
                per_position = ids.gather(per_position)
            last = (mb.prompt_lengths.to(end.device) + end).clamp(min=0, max=per_position.shape[1] - 1)
            score = per_position.gather(1, last.to(per_position.device)[:, None])
            tls = torch.zeros(mask.shape, dtype=torch.float32, device=score.device)
            tls.scatter_(1, end.clamp(min=0).to(score.device)[:, None], score)
            return tls * mask.to(tls.device)
        return self._forward(batch, micro_batch_size, max_token_len, per_sample)


def _use_foreach(optimizer) -> None:
    """torch's Adam/SGD pick their per-tensor loop unless parameters are on CUDA; the foreach
    (multi-tensor) form computes the same update in a few kernels instead of ~10 per parameter
    (on CPU, 4.6 ms -> well under 1 ms per step of a tiny model). Megatron builds torch's
    optimizers when TransformerEngine/apex are absent; TE's fused optimizers have no such key."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)):
            for group in inner.param_groups:
                group["foreach"] = True
