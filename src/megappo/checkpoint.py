"""Checkpoints: megatron dist_checkpointing of workers (model + optimizer + LR schedule, loadable
under another TP/PP) and the trainer's own state, published atomically.

Files under ``root``::

    global_step_N/actor/         dist_checkpointing folder (+ huggingface/: source config, tokenizer;
                                 a LoRA worker: lora.json, and only what trains is saved)
    global_step_N/critic/        (when the run has a critic)
    global_step_N/rank_state/    rank_<r>.pt: each rank's RNG states
    global_step_N/trainer_state.json
    global_step_N/manifest.json  size and CRC-32 of every file (checked on load)
    latest                       "N": written last, by rename, so it never names a partial save

A save goes to ``.tmp_global_step_N`` and is renamed into place only when every rank finished;
a crash mid-save leaves the previous checkpoint and ``latest`` untouched.

megatron-core 0.16.1 on the torch-Adam path (no apex/TE; GPU too) mishandles distributed-
optimizer state on load: a fresh optimizer has no ``step`` state to load into, and the loaded
state makes every parameter share ONE ``step`` tensor (Adam's bias correction then advances
once per parameter per step). :func:`load_worker` creates the state first and un-shares ``step``.

Mixture-of-Experts: with expert parallelism megatron chains two optimizers (dense parameters;
expert parameters over the expert-data-parallel group), at EP1 it builds one. Optimizer tensors
are therefore saved keyed by parameter only (no ``chained_N.`` prefix), and on load the
optimizer's non-tensor state (param groups, Adam's step) is rebuilt for the live chain from the
saved one, so a checkpoint loads at any TP/PP/EP. Expert weights are keyed by global expert
index (megatron's SequentialMLP sharded state dict), MoE models' layers by layer index.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import zlib
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["save_checkpoint", "load_checkpoint", "latest_step", "save_worker", "load_worker", "verify_checkpoint",
           "load_start_weights", "read_rank_state", "CheckpointError", "TRUST_PICKLES",
           "end_writer_process", "in_process_write_results", "read_lora_file", "LORA_FILE", "is_resumable"]

# Resuming a checkpoint whose per-rank state holds pickled Python objects (what megappo wrote
# before it saved plain tensors) needs this set to 1 once: such a file can run code on load.
TRUST_PICKLES = "MEGAPPO_TRUST_PICKLED_CHECKPOINT"

# fully_reshardable: optimizer tensors keyed like the parameters' global tensors (any TP/PP/DP);
# no chained_N. prefix: the chain of optimizers depends on the expert-parallel size.
_META = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
# Keys matching a live optimizer's param group to a saved one. megatron also keys on
# is_expert_parallel, which is False for every group at EP1 and True for expert groups at EP > 1.
_GROUP_ID = ("wd_mult", "lr_mult", "is_decoupled_lr")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used: names the path and what is wrong."""


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _model_keys(worker) -> list[str]:
    return _model_keys_of(worker.chunks)


def _model_keys_of(chunks) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]


def _sharded(worker, is_loading: bool) -> dict:
    sd = {k: c.sharded_state_dict() for k, c in zip(_model_keys(worker), worker.chunks)}
    if _lora(worker):
        # LoRA: the frozen base is model.path's weights, unchanged by training; a checkpoint holds
        # what trains (adapters, a critic's value head) and its optimizer state
        sd = {k: {n: t for n, t in d.items() if not _frozen(t)} for k, d in sd.items()}
    if worker.optimizer is not None:
        model_sd = {k: sd[k] for k in _model_keys(worker)}
        sd["optimizer"] = worker.optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=_META)
        sd["scheduler"] = worker.scheduler.state_dict()
    return sd


def _lora(worker) -> bool:
    from megappo.models import has_lora

    return has_lora(worker.chunks)


def _frozen(t) -> bool:
    """A sharded entry over a frozen weight (a ShardedTensor, or the factory megatron makes of the
    fused gate/up weight); objects (extra state) count as not frozen."""
    data = getattr(t, "data", None)
    return isinstance(data, torch.Tensor) and not data.requires_grad


LORA_FILE = "lora.json"   # in a LoRA worker's folder: the adapters' spec and the base they go on


def _write_lora_file(worker, path: str, base: Optional[str]) -> None:
    from megappo.models import lora_spec_of

    spec = lora_spec_of(worker.chunks)
    with open(os.path.join(path, LORA_FILE), "w") as f:
        json.dump({"r": spec.rank, "lora_alpha": spec.alpha, "target_modules": list(spec.modules),
                   "base_model_name_or_path": base}, f, indent=1)


def read_lora_file(path: str) -> Optional[dict]:
    """A worker checkpoint's LoRA facts (rank, alpha, modules, base model), None: full weights."""
    f = os.path.join(path, LORA_FILE)
    if not os.path.isfile(f):
        return None
    with open(f) as fh:
        return json.load(fh)


def save_worker(worker, path: str) -> None:
    from megatron.core import dist_checkpointing

    if _rank0():
        os.makedirs(path, exist_ok=True)
    _barrier()
    in_process_write_results()
    dist_checkpointing.save(_sharded(worker, is_loading=False), path)


def in_process_write_results() -> None:
    """Give megatron's file writer a plain in-process queue for its write results, before a
    synchronous ``dist_checkpointing.save``. Its own (made once per process) is a
    ``multiprocessing`` Manager's queue, so that an asynchronous save's writer process can reach
    it: a spawned server process that imports torch to unpickle the first results (~2 s of a
    process's first save, measured on 2 CPU cores, 2026-12-07) and then holds ~0.5 GB for the
    process's life. A synchronous save runs the writer in the saving process itself
    (``AsyncRequest.execute_sync``), which puts the results and reads them back: a plain queue
    does. megappo's saves are all synchronous; an asynchronous save after this would need
    megatron's queue back (set ``_results_queue`` to None)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    if getattr(fa, "_results_queue", False) is None:
        fa._results_queue = queue.Queue()


def end_writer_process() -> bool:
    """End the process megatron's file writer keeps for the rest of the process's life where it
    started one (an asynchronous save outside megappo's, or one made before
    :func:`in_process_write_results`): a ``multiprocessing`` Manager (a spawned server, ~0.5 GB)
    for its results queue. At exit multiprocessing ends it anyway; a long-lived caller (a test
    run, a notebook) calls this instead of carrying it. Returns whether one was running."""
    import sys

    fa = sys.modules.get("megatron.core.dist_checkpointing.strategies.filesystem_async")
    queue = getattr(fa, "_results_queue", None)
    if queue is None:
        return False
    manager = getattr(queue, "_manager", None)
    fa._results_queue = None
    if manager is None:
        return False
    manager.shutdown()
    return True


def _ensure_optimizer_state(worker) -> None:
    """Give every parameter its optimizer state (incl. ``step``) without changing any weight:
    one step at learning rate 0 and zero weight decay on zero gradients."""
    opt = worker.optimizer
    groups = opt.param_groups
    saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in groups]
    for g in groups:
        g["lr"] = 0.0
        g["weight_decay"] = 0.0
    worker._zero_grad()
    opt.step()
    for g, (lr, wd) in zip(groups, saved):
        g["lr"], g["weight_decay"] = lr, wd


def _inner_states(worker):
    for opt in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            yield from inner.state.values()


def _tolerate_missing_step(opt) -> None:
    """megatron restores Adam's ``step`` into the live state from the checkpoint's param groups,
    then copies each parameter's saved tensors over every live key, ``step`` included, which the
    per-parameter checkpoint data does not hold (KeyError 'step'). Keep the restored step."""
    if not hasattr(opt, "_set_main_param_and_optimizer_states") or getattr(opt, "_megappo_step_fix", False):
        return
    original = opt._set_main_param_and_optimizer_states

    def set_states(model_param, tensors):
        group, order = opt.model_param_group_index_map[model_param]
        live = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]]
        if "step" in live and "step" not in tensors:
            tensors = {**tensors, "step": live["step"]}
        return original(model_param, tensors)

    opt._set_main_param_and_optimizer_states = set_states
    opt._megappo_step_fix = True


def _unshare_adam_step(worker) -> None:
    for state in _inner_states(worker):
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


def _optimizers(worker) -> list:
    return list(getattr(worker.optimizer, "chained_optimizers", [worker.optimizer]))


class _Loaded:
    """Marks where the request holds a tensor that the load fills in."""


def _skeleton(tree):
    """The request's structure: plain values kept, local-only values unwrapped, sharded leaves
    marked (taken before the load, which rewrites the request in place)."""
    from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedBase,
                                                          ShardedTensorFactory)

    if isinstance(tree, (ShardedBase, ShardedTensorFactory)):
        return _Loaded
    if isinstance(tree, LocalNonpersistentObject):
        return tree.unwrap()
    if isinstance(tree, dict):
        return {k: _skeleton(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_skeleton(v) for v in tree]
    return tree


def _fill(skel, loaded, where: str):
    """The skeleton with each marked leaf replaced by what the load put at its place."""
    if skel is _Loaded:
        if loaded is None:
            raise CheckpointError(f"{where} was not loaded")
        return loaded
    if isinstance(skel, dict):
        return {k: _fill(v, loaded.get(k) if isinstance(loaded, dict) else None, f"{where}.{k}")
                for k, v in skel.items()}
    if isinstance(skel, list):
        return [_fill(v, loaded[i] if isinstance(loaded, list) and i < len(loaded) else None, f"{where}[{i}]")
                for i, v in enumerate(skel)]
    return skel


def _saved_optimizers(common) -> list:
    """The saved optimizer(s)' non-tensor state: one per chained optimizer at save time."""
    if isinstance(common, dict) and common and all(isinstance(k, int) for k in common):
        return [common[k] for k in sorted(common)]
    return [common]


def _inner(opt_state: dict) -> dict:
    """The torch optimizer's part of one optimizer's state (the distributed optimizer and the
    fp16/bf16 one nest it under ``optimizer``)."""
    return opt_state["optimizer"] if isinstance(opt_state.get("optimizer"), dict) else opt_state


def _groups(opt_state: dict) -> list:
    return _inner(opt_state).get("param_groups") or []


def _common_step(opt_state: dict):
    st = _inner(opt_state).get("state")
    return st.get("common_step") if isinstance(st, dict) else None


def _like(live, value: float):
    """``value`` in the live value's type (a tensor, an int or a float step count)."""
    if isinstance(live, torch.Tensor):
        return torch.as_tensor(value, dtype=live.dtype, device=live.device)
    return int(value) if isinstance(live, int) else float(value)


def _saved_step(saved: list, path: str) -> float:
    """Adam's step count of the saved optimizer(s) (the distributed optimizer keeps it in its
    param groups, the others as ``common_step``); chained optimizers share it."""
    steps = {float(g["step"]) for st in saved for g in _groups(st) if g.get("step") is not None}
    steps |= {float(_common_step(st)) for st in saved if _common_step(st) is not None}
    if len(steps) != 1:
        raise CheckpointError(f"{path}: the optimizer state holds "
                              f"{'no Adam step count' if not steps else f'different Adam step counts {sorted(steps)}'}")
    return steps.pop()


def _optimizer_state(worker, skeletons: list, loaded, common, path: str):
    """The state dict ``worker.optimizer.load_state_dict`` takes, for the live chain of
    optimizers: the tensors the load put at the live request's places, the saved param-group
    settings (matched on the wd/lr multipliers), the saved step count and loss scaler."""
    live = _optimizers(worker)
    saved = _saved_optimizers(common)
    step = _saved_step(saved, path)
    saved_groups = {tuple(g.get(k) for k in _GROUP_ID): g for st in saved for g in _groups(st)}
    out = []
    for i, skel in enumerate(skeletons):
        part = loaded if len(live) == 1 else (loaded or {}).get(i)
        state = _fill(skel, part, f"{path}: optimizer state optimizer{'' if len(live) == 1 else f'.{i}'}")
        for g in _groups(state):
            old = saved_groups.get(tuple(g.get(k) for k in _GROUP_ID), {})
            g.update({k: v for k, v in old.items() if k not in ("params", "is_expert_parallel", "step") and k in g})
            if "step" in g:
                g["step"] = _like(g["step"], step)
        if _common_step(state) is not None:
            _inner(state)["state"]["common_step"] = _like(_common_step(state), step)
        if len(saved) == len(live) and "grad_scaler" in state and "grad_scaler" in saved[i]:
            state["grad_scaler"] = saved[i]["grad_scaler"]
        out.append(state)
    return out[0] if len(live) == 1 else dict(enumerate(out))


def _check_model_shapes(request: dict, path: str) -> None:
    """Every model tensor the workers ask for is in the checkpoint with the same global shape;
    else one CheckpointError naming the tensors (e.g. another num_experts or vocabulary)."""
    from megatron.core import dist_checkpointing

    try:
        saved = dist_checkpointing.load_tensors_metadata(path)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot read the checkpoint metadata: {type(e).__name__}: {e}") from e
    problems, _ = _model_problems(request, saved)
    if problems:
        raise CheckpointError(f"{path}: the checkpoint does not match the model: {_first(problems)}")


def _first(problems: list[str], n: int = 3) -> str:
    return "; ".join(problems[:n]) + (f" (+{len(problems) - n} more)" if len(problems) > n else "")


def _model_problems(request: dict, saved: dict) -> tuple[list[str], list[str]]:
    """(problems, missing keys): the requested model tensors absent from the checkpoint's
    metadata ``saved`` or of another global shape (shape-tolerant ones excepted)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    problems, missing, seen = [], [], set()
    for sh in nested_values(request):
        if not isinstance(sh, (ShardedTensor, ShardedTensorFactory)) or sh.key in seen or "_extra_state" in sh.key:
            continue
        seen.add(sh.key)
        if sh.key not in saved:
            problems.append(f"{sh.key} is missing from the checkpoint")
            missing.append(sh.key)
        elif isinstance(sh, ShardedTensor) and not sh.allow_shape_mismatch:
            have, want = tuple(saved[sh.key].global_shape), tuple(sh.global_shape)
            if have != want:
                problems.append(f"{sh.key} is {have} in the checkpoint, the model has {want}")
    return problems, missing


def _check_lora_matches(worker, path: str) -> None:
    """A LoRA checkpoint (adapters only) into a LoRA worker of the same spec; full weights into a
    full-weight worker. Anything else is refused before loading, naming both."""
    from megappo.models import lora_spec_of

    saved = read_lora_file(path)
    if not _lora(worker):
        if saved is not None:
            raise CheckpointError(f"{path}: holds LoRA adapters (rank {saved['r']}) but this run trains full weights "
                                  f"(set actor_rollout_ref.model.lora_rank={saved['r']} and lora_alpha, target_modules "
                                  f"as saved to resume it)")
        return
    spec = lora_spec_of(worker.chunks)
    if saved is None:
        raise CheckpointError(f"{path}: holds full weights but this run trains LoRA adapters (rank {spec.rank}); "
                              f"resume it with lora_rank=0, or start the LoRA run fresh")
    mine = {"r": spec.rank, "lora_alpha": spec.alpha, "target_modules": list(spec.modules)}
    theirs = {k: saved.get(k) for k in mine}
    if theirs != mine:
        raise CheckpointError(f"{path}: its adapters are {theirs}, this run's are {mine}")


def load_worker(worker, path: str) -> None:
    from megatron.core import dist_checkpointing

    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a checkpoint directory")
    _check_lora_matches(worker, path)
    if worker.optimizer is not None:
        _ensure_optimizer_state(worker)
    request = _sharded(worker, is_loading=True)
    _check_model_shapes({k: request[k] for k in _model_keys(worker)}, path)
    skeletons = common = None
    if worker.optimizer is not None:
        try:
            common = dist_checkpointing.load_common_state_dict(path)
        except Exception as e:
            raise CheckpointError(f"{path}: cannot load: {type(e).__name__}: {e}") from e
        if "optimizer" not in common:
            raise CheckpointError(f"{path}: the checkpoint holds no optimizer state (model weights only); load it "
                                  f"into a worker without an optimizer, or with "
                                  f"megappo.convert.megatron_ckpt.load_model_weights")
        opt = request["optimizer"]
        skeletons = [_skeleton(opt)] if len(_optimizers(worker)) == 1 else [_skeleton(opt[i]) for i in sorted(opt)]
    try:
        state = dist_checkpointing.load(request, path)
    except Exception as e:
        raise CheckpointError(f"{path}: cannot load: {type(e).__name__}: {e}") from e
    for key, chunk in zip(_model_keys(worker), worker.chunks):
        # Not strict: TE's _extra_state entries may be absent; every real tensor must be there.
        res = chunk.load_state_dict(state[key], strict=False)
        missing = [k for k in res.missing_keys if not k.endswith("_extra_state") and k in request[key]]
        if missing:
            raise CheckpointError(f"{path}: the checkpoint lacks {len(missing)} model tensor(s) the model has: "
                                  f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if worker.optimizer is not None:
        for opt in _optimizers(worker):
            _tolerate_missing_step(opt)
        worker.optimizer.load_state_dict(_optimizer_state(worker, skeletons, state.get("optimizer"),
                                                          common["optimizer"], path))
        steps = {type(st.get("step")).__name__ for st in _inner_states(worker)}
        if "NoneType" in steps:
            raise CheckpointError(f"{path}: the optimizer state was loaded without Adam's step counts")
        _unshare_adam_step(worker)
        worker.scheduler.load_state_dict(state["scheduler"])


_VALUE_HEAD = ("output_layer.weight", "output_layer.bias")


def _drop_value_head(request: dict, saved: dict, prefix: str) -> tuple[set, list[str]]:
    """A critic starting from a language-model checkpoint keeps its initialised value head:
    megatron marks output_layer.weight shape-tolerant (vocabulary padding), so a (vocab, hidden)
    LM head would otherwise load silently into the (1, hidden) value head as its first row.
    Drops the head's entries from ``request`` (in place) unless the checkpoint holds a value head
    (a head saved without bias keeps its bias 0). Returns (the module names dropped, notes)."""
    w, b = (prefix + k for k in _VALUE_HEAD)
    have = [sd for sd in request.values() if w in sd]
    if not have:
        return set(), []     # not the last pipeline stage
    want = tuple(have[0][w].global_shape)
    got = tuple(saved[w].global_shape) if w in saved else None
    drop = ([w, b] if got != want else []) + ([b] if b not in saved else [])
    for sd in have:
        for k in drop:
            sd.pop(k, None)
    if got == want:
        return {k[len(prefix):] for k in drop}, []
    what = f"a language-model head of shape {got}" if got else "no output layer"
    return set(_VALUE_HEAD), [f"the checkpoint has {what}: the value head keeps its initialisation"]


def _unexpected_keys(request: dict, saved: dict, prefix: str, skip: set) -> list[str]:
    """Model tensors of the checkpoint that no rank of this model asks for (collective): another
    depth, experts the model lacks, or a different architecture. Optimizer state and TE's
    extra state are not model tensors."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    mine = {getattr(sh, "key", None) for sh in nested_values(request)}
    everyone = set()
    for keys in _all_gather_str(json.dumps(sorted(k for k in mine if k))):
        everyone.update(json.loads(keys))
    return sorted(k for k in saved if k.startswith(prefix) and not k.startswith("optimizer.")
                  and "_extra_state" not in k and k not in everyone and k not in skip)


def _prefix_hint(missing: list[str], saved: dict, prefix: str) -> str:
    """When the model's names sit in the checkpoint under another prefix: which to set."""
    for key in missing:
        bare = key[len(prefix):]
        for k in saved:
            if k.endswith("." + bare) or (k.endswith(bare) and k != bare):
                return f" (the checkpoint names it {k!r}: set dist_checkpointing_prefix={k[:-len(bare)]!r})"
    return ""


def load_start_weights(chunks, path: str, *, prefix: str = "", value_head: bool = False, key: str = "") -> list[str]:
    """A role's starting weights from a megatron-core dist_checkpointing model checkpoint (verl's
    converter_hf_to_mcore.py, a megappo or verl training checkpoint, or dist_checkpointing.save
    of a model's sharded_state_dict(prefix)) into ``chunks`` built at any TP/PP/EP. Checked
    before anything loads, on every rank together: each tensor the model has is in the checkpoint
    with the same global shape (vocabulary padding may differ) and the checkpoint has no model
    tensor the model lacks; else one CheckpointError on every rank naming ``key`` and the tensors.
    TE's extra state is not read (a checkpoint from the local layer spec has none). Returns notes
    for the log. Collective over the world, like megatron's load."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    where = f"{key}={path}" if key else path
    try:
        saved = dist_checkpointing.load_tensors_metadata(path)
    except Exception as e:
        saved, err = {}, e
    else:
        err = None
    _agree(err, f"{where}: cannot read the checkpoint metadata")
    request = {k: c.sharded_state_dict(prefix=prefix) for k, c in zip(_model_keys_of(chunks), chunks)}
    for sd in request.values():
        for k in [k for k, v in sd.items() if isinstance(v, ShardedObject) and k.endswith("_extra_state")]:
            del sd[k]
    dropped, notes = _drop_value_head(request, saved, prefix) if value_head else (set(), [])
    problems, missing = _model_problems(request, saved)
    err = CheckpointError(f"the checkpoint does not match the model: {_first(problems)}"
                          f"{_prefix_hint(missing, saved, prefix)}") if problems else None
    _agree(err, where)
    extra = _unexpected_keys(request, saved, prefix, {prefix + k for k in _VALUE_HEAD} if value_head else set())
    if extra:
        raise CheckpointError(f"{where}: the checkpoint does not match the model: it has {len(extra)} tensor(s) the "
                              f"model lacks: {_first(extra)} (another number of layers or experts, or another "
                              f"model than model.path's config.json?)")
    try:
        state = dist_checkpointing.load(request, path)
        for k, chunk in zip(_model_keys_of(chunks), chunks):
            # the load returns the request's names, which carry the prefix; the module's do not
            res = chunk.load_state_dict({n[len(prefix):]: v for n, v in state[k].items()}, strict=False)
            left = [m for m in res.missing_keys if not m.endswith("_extra_state") and m not in dropped]
            if left:
                raise CheckpointError(f"the checkpoint left {len(left)} model tensor(s) unset: {_first(left, 5)}")
    except Exception as e:
        err = e
    _agree(err, f"{where}: cannot load")
    return notes


def latest_step(root: str) -> Optional[int]:
    p = os.path.join(root, "latest")
    if not os.path.isfile(p):
        return None
    text = open(p).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{p}: expected a step number, found {text!r}")
    step = int(text)
    if not os.path.isfile(os.path.join(root, f"global_step_{step}", "trainer_state.json")):
        raise CheckpointError(f"{p} names step {step}, but global_step_{step}/trainer_state.json is missing")
    return step


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rank_file(path: str, rank: int) -> str:
    return os.path.join(path, "rank_state", f"rank_{rank}.pt")


HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
            "chat_template.jinja")


def copy_hf_files(src: str, dst: str) -> None:
    """The source model's config, generation config and tokenizer files (no weights): what a
    converter needs to turn the checkpoint back into a HuggingFace folder."""
    os.makedirs(dst, exist_ok=True)
    for name in HF_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))


def _all_gather_str(msg: str) -> list[str]:
    if not dist.is_initialized():
        return [msg]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, msg)
    return out


def _agree(err: Optional[BaseException], what: str) -> None:
    """Collective: raise the same CheckpointError on every rank when any rank failed ``what``."""
    msgs = _all_gather_str("" if err is None else _describe(err))
    bad = [(r, m) for r, m in enumerate(msgs) if m]
    if bad:
        r, m = bad[0]
        raise CheckpointError(f"{what}: rank {r}: {m}") from err


def _describe(err: BaseException) -> str:
    e = err
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return f"disk full ({e})"
        e = e.__cause__ or e.__context__
    return f"{type(err).__name__}: {err}"


MANIFEST = "manifest.json"


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def _write_manifest(folder: str) -> None:
    """Size and CRC-32 of every file of the checkpoint: a load detects truncation and corruption
    and names the file, instead of failing deep inside torch.distributed.checkpoint."""
    entries = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, folder)
            if rel != MANIFEST:
                entries[rel] = [os.path.getsize(full), _crc32(full)]
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(entries, f, indent=0, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def verify_checkpoint(path: str, checksums: bool = True) -> None:
    """Check ``path`` against its manifest (sizes; CRC-32 too with ``checksums``). Raises
    CheckpointError naming the first missing, truncated or corrupted file. Checkpoints without
    a manifest (written by other tools) pass unchecked."""
    mf = os.path.join(path, MANIFEST)
    if not os.path.isfile(mf):
        return
    try:
        with open(mf) as f:
            entries = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{mf}: unreadable manifest: {e}") from e
    for rel, (size, crc) in sorted(entries.items()):
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"{full}: missing from the checkpoint")
        have = os.path.getsize(full)
        if have != size:
            raise CheckpointError(f"{full}: truncated or overwritten: {have} bytes, the checkpoint wrote {size}")
        if checksums and _crc32(full) != crc:
            raise CheckpointError(f"{full}: corrupted: its CRC-32 does not match the one written at save time")


def save_checkpoint(root: str, step: int, workers: dict, trainer_state: dict, max_to_keep: Optional[int] = None,
                    per_rank_state: Optional[dict] = None, hf_sources: Optional[dict] = None,
                    hf_weights: Optional[dict] = None, resumable: bool = True,
                    lora_bases: Optional[dict] = None) -> str:
    """Save every worker and the trainer state as ``global_step_<step>``; publish atomically.
    ``per_rank_state`` (e.g. RNG states) is written by every rank to ``rank_state/rank_<r>.pt``;
    ``hf_sources`` {worker name: HF model folder} adds ``<name>/huggingface/`` (config, tokenizer);
    ``hf_weights`` {worker name: writer(folder, write)} writes that worker's weights there too,
    making it a HuggingFace model folder (:func:`megappo.convert.live_hf_writer`: collective, the
    rank with ``write`` writes; it reads and rewrites the folder's config.json). Without
    ``resumable`` only those HF folders are written (no worker state, no trainer state) and
    ``latest`` is left alone: such a save is an export, never resumed from. ``lora_bases``
    {worker name: the model folder its LoRA adapters were trained on, as the user named it}
    (default: ``hf_sources``).

    Collective. When any rank fails (disk full, I/O error), every rank raises the same
    CheckpointError naming the rank and the cause; the partial save is removed and the previous
    checkpoint and ``latest`` are untouched."""
    final = os.path.join(root, f"global_step_{step}")
    tmp = os.path.join(root, f".tmp_global_step_{step}")
    try:
        prev = latest_step(root)
        kept = ("no earlier checkpoint exists" if prev is None
                else f"the previous checkpoint global_step_{prev} and 'latest' are untouched")
    except CheckpointError:
        kept = "'latest' is untouched"
    what = f"checkpoint {final} was not saved ({kept})"

    def stage(fn) -> None:
        _stage(fn, what, tmp)

    def fresh() -> None:
        if _rank0():
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)

    def state(name: str, worker) -> None:
        save_worker(worker, os.path.join(tmp, name))
        if _rank0() and _lora(worker):
            _write_lora_file(worker, os.path.join(tmp, name), (lora_bases or hf_sources or {}).get(name))

    def rank_state() -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        os.makedirs(os.path.dirname(_rank_file(tmp, rank)), exist_ok=True)
        torch.save(per_rank_state, _rank_file(tmp, rank))

    def finish() -> None:
        if not _rank0():
            return
        for name, src in (hf_sources or {}).items():
            if name not in (hf_weights or {}) and resumable:   # (an HF export has its files)
                copy_hf_files(src, os.path.join(tmp, name, "huggingface"))
        if resumable:
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump({"step": step, **trainer_state}, f)
                f.flush()
                os.fsync(f.fileno())
        _write_manifest(tmp)
        _publish(root, tmp, final, step, point_latest=resumable)

    stage(fresh)
    for name, worker in workers.items():
        if resumable:
            stage(lambda: state(name, worker))
        if name in (hf_weights or {}):
            stage(lambda: _save_hf_weights(hf_weights[name], (hf_sources or {})[name], os.path.join(tmp, name)))
    if per_rank_state is not None and resumable:
        stage(rank_state)
    stage(finish)
    if _rank0() and max_to_keep:
        _prune(root, max_to_keep, resumable)
    _barrier()
    return final


def _stage(fn, what: str, tmp: str) -> None:
    """One part of a save, on every rank; a failure on any rank is raised on all of them before
    the next part's collectives start (and the partial save ``tmp`` is removed)."""
    err = None
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - reported collectively
        err = e
    try:
        _agree(err, what)
    except CheckpointError:
        if _rank0():
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def is_resumable(folder: str) -> bool:
    """A checkpoint to resume (trainer_state.json written last), not an export of HF weights only."""
    return os.path.isfile(os.path.join(folder, "trainer_state.json"))


def _prune(root: str, keep: int, resumable: bool) -> None:
    """The ``keep`` newest saves of this save's kind stay (resumable checkpoints and HF exports
    are counted apart); the checkpoint ``latest`` names is never removed."""
    try:
        latest = latest_step(root)
    except CheckpointError:
        latest = None
    steps = sorted(int(d.split("_")[-1]) for d in os.listdir(root)
                   if d.startswith("global_step_") and d.split("_")[-1].isdigit()
                   and is_resumable(os.path.join(root, d)) == resumable)
    for old in steps[:-keep]:
        if old != latest:
            shutil.rmtree(os.path.join(root, f"global_step_{old}"), ignore_errors=True)


def _save_hf_weights(writer, src: str, folder: str) -> None:
    """``<folder>/huggingface``: the source model's files, then ``writer(out, write)`` (collective;
    rank 0 writes) adds the weights."""
    out = os.path.join(folder, "huggingface")
    err = None
    if _rank0():
        try:
            copy_hf_files(src, out)
        except Exception as e:  # noqa: BLE001 - raised after the walk: the other ranks' gathers must pair up
            err = e
    writer(out, _rank0() and err is None)
    if err is not None:
        raise err


def _publish(root: str, tmp: str, final: str, step: int, point_latest: bool = True) -> None:
    """Rename the finished save into place, then point ``latest`` at it (also by rename). An
    older folder of the same step is moved aside first and deleted last, so at every instant
    ``latest`` names a complete checkpoint."""
    old = None
    if not point_latest and is_resumable(final):
        raise CheckpointError(f"{final} holds a resumable checkpoint: an HF export of the same step does not replace it")
    if os.path.exists(final):
        old = os.path.join(root, f".old_global_step_{step}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    if not point_latest:
        _fsync_dir(root)
        if old:
            shutil.rmtree(old, ignore_errors=True)
        return
    latest_tmp = os.path.join(root, ".latest.tmp")
    with open(latest_tmp, "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    os.replace(latest_tmp, os.path.join(root, "latest"))
    _fsync_dir(root)
    if old:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str, workers: dict, with_rank_state: bool = False):
    """Load ``global_step_N`` into the workers (any TP/PP layout); returns the trainer state, and
    with ``with_rank_state`` also this rank's saved per-rank state (None when it has none)."""
    meta = os.path.join(path, "trainer_state.json")
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if not os.path.isfile(meta):
        hf = os.path.join(path, "actor", "huggingface")
        if os.path.isfile(os.path.join(hf, "config.json")) and any(f.endswith(".safetensors") for f in os.listdir(hf)):
            raise CheckpointError(f"{path}: holds HuggingFace weights only (checkpoint.save_contents without model, "
                                  f"optimizer and extra): nothing to resume; start a new run from them with "
                                  f"actor_rollout_ref.model.path={hf}")
        raise CheckpointError(f"{path}: no trainer_state.json (not a finished megappo checkpoint)")
    err = None
    try:
        verify_checkpoint(path, checksums=_rank0())  # sizes everywhere, checksums read once
    except CheckpointError as e:
        err = e
    msgs = _all_gather_str("" if err is None else str(err))
    bad = [m for m in msgs if m]
    if bad:
        raise CheckpointError(bad[0]) from err
    try:
        with open(meta) as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{meta}: unreadable trainer state: {e}") from e
    for name, worker in workers.items():
        load_worker(worker, os.path.join(path, name))
    if not with_rank_state:
        return state
    return state, read_rank_state(path, dist.get_rank() if dist.is_initialized() else 0)


def read_rank_state(path: str, rank: int) -> Optional[dict]:
    """Rank ``rank``'s saved per-rank state in checkpoint ``path`` (None when it has none), read
    with torch.load(weights_only=True): tensors and plain types only, so a checkpoint directory
    from elsewhere cannot run code. A file holding other objects is refused with how to proceed."""
    import pickle

    rf = _rank_file(path, rank)
    if not os.path.isfile(rf):
        return None
    try:
        return torch.load(rf, weights_only=True)
    except pickle.UnpicklingError as e:
        if os.environ.get(TRUST_PICKLES) != "1":
            raise CheckpointError(
                f"{rf}: holds Python objects that loading would have to execute, refused (torch.load "
                f"weights_only=True; a checkpoint copied from elsewhere could run code this way). An older "
                f"megappo wrote its per-rank state like this: if you trust this checkpoint, resume from it once "
                f"with {TRUST_PICKLES}=1 (later saves are plain tensors). Refused: {str(e).splitlines()[0]}") from e
    except Exception as e:
        raise CheckpointError(f"{rf}: unreadable per-rank state: {type(e).__name__}: {e}") from e
    try:
        return torch.load(rf, weights_only=False)
    except Exception as e:
        raise CheckpointError(f"{rf}: unreadable per-rank state: {type(e).__name__}: {e}") from e
