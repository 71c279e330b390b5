"""The run's state across a restart: a checkpoint of the workers, the data order, the KL
controller, each rank's RNG streams and (one-step off) the generation in flight; and its resume,
after which the run continues exactly as the uninterrupted one would have."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

from megappo import rng, watchdog

__all__ = ["checkpointed_workers", "save", "resume", "Resumed", "check_run_dir"]


@dataclasses.dataclass
class Resumed:
    path: Optional[str]   # the checkpoint loaded (None: a fresh start)
    step: int = 0
    inflight: object = None


def checkpointed_workers(actor, critic) -> dict:
    """The checkpointed workers, with all their state on the device (saving and loading read and
    write every tensor)."""
    workers = {"actor": actor, **({"critic": critic} if critic is not None else {})}
    for w in workers.values():
        w.state_offload.reload_all()
    return workers


# a checkpoint's write or load may hold the interpreter for minutes (pickling, hashing shards)
@watchdog.in_phase("save_checkpoint", watchdog.SLOW)
def save(cfg, step: int, workers: dict, sampler, algo_state: dict, world: int, layout, inflight,
         replay=None) -> str:
    """``global_step_<step>`` under ``trainer.default_local_dir``, published atomically.
    ``algo_state``: name -> object with state_dict() (the KL controller, group_cv's running sums);
    ``replay``: this rank's :class:`~megappo.trainer.replay.CriticReplay` (saved per rank)."""
    from megappo.builders import model_folder
    from megappo.checkpoint import save_checkpoint
    from megappo.config import resumable_checkpoints
    from megappo.convert import live_hf_writer

    tr = cfg.trainer
    keep = tr.max_actor_ckpt_to_keep or tr.max_critic_ckpt_to_keep  # equal when both set (validate)
    hf = {"actor": model_folder(cfg.actor_rollout_ref.model)}   # config.json with override_config's entries
    if "critic" in workers:
        hf["critic"] = model_folder(cfg.critic.model)
    state = {"data": sampler.state_dict(), "world_size": world, "layout": dataclasses.asdict(layout),
             **{name: obj.state_dict() for name, obj in algo_state.items()}}
    contents = {"actor": cfg.actor_rollout_ref.actor.checkpoint.save_contents,
                "critic": cfg.critic.checkpoint.save_contents}
    # a LoRA adapter's base, as the user named it (not the folder of override_config's entries)
    bases = {name: os.path.expanduser(p) for name, p in (("actor", cfg.actor_rollout_ref.model.path),
                                                           ("critic", cfg.critic.model.path)) if name in workers}
    exports = {name: live_hf_writer(w.chunks, w.desc, base_model=bases[name])
               for name, w in workers.items() if "hf_model" in contents[name]}
    return save_checkpoint(os.path.expanduser(tr.default_local_dir), step, workers, state, max_to_keep=keep,
                           per_rank_state={**rng.capture(), "inflight": _plain_inflight(inflight),
                                           **({"critic_replay": replay.state_dict()} if replay is not None else {})},
                           hf_sources=hf, hf_weights=exports, resumable=resumable_checkpoints(cfg), lora_bases=bases)


def check_run_dir(cfg) -> None:
    """Before anything is built: a resume that checkpoint.load_contents would leave without the
    state it needs is refused, and so is a start over (resume_mode=auto finding no 'latest') in a
    folder holding HF exports it would overwrite, or a run of exports (resume_mode=disable) in a
    folder of checkpoints its exports may not replace."""
    from megappo.checkpoint import CheckpointError, is_resumable, latest_step
    from megappo.config import critic_enabled, resumable_checkpoints

    tr = cfg.trainer
    root = os.path.expanduser(tr.default_local_dir)
    step = latest_step(root) if tr.resume_mode == "auto" and os.path.isdir(root) else None
    target = (os.path.join(root, f"global_step_{step}") if step is not None else None if tr.resume_mode in ("auto", "disable")
              else os.path.expanduser(tr.resume_from_path if tr.resume_mode == "resume_path" else tr.resume_mode))
    loads = {"actor_rollout_ref.actor": cfg.actor_rollout_ref.actor.checkpoint.load_contents}
    if critic_enabled(cfg):
        loads["critic"] = cfg.critic.checkpoint.load_contents
    for role, load in loads.items():
        if target is not None and not {"model", "optimizer", "extra"} <= set(load):
            raise CheckpointError(f"{target}: trainer.resume_mode={tr.resume_mode} resumes from it, but "
                                  f"{role}.checkpoint.load_contents={load} would load neither its weights "
                                  f"nor its optimizer: set it to [model, optimizer, extra], or trainer.resume_mode=disable")
    if not os.path.isdir(root) or step is not None or tr.resume_mode not in ("auto", "disable"):
        return
    saves = sorted((d for d in os.listdir(root) if d.startswith("global_step_") and d.rsplit("_", 1)[-1].isdigit()),
                   key=lambda d: int(d.rsplit("_", 1)[-1]))
    exports = [d for d in saves if not is_resumable(os.path.join(root, d))]
    kept = [d for d in saves if d not in exports]
    if tr.resume_mode == "auto" and exports:
        raise CheckpointError(
            f"{root} holds HuggingFace exports of an earlier run ({exports[0]} .. {exports[-1]}) and no checkpoint to "
            f"resume ('latest' is absent): starting over would overwrite them. Choose another trainer.default_local_dir, "
            f"move them, or set trainer.resume_mode=disable to start over here")
    if tr.resume_mode == "disable" and kept and not resumable_checkpoints(cfg):
        raise CheckpointError(
            f"{root} holds resumable checkpoints ({kept[0]} .. {kept[-1]}) and this run's saves are HuggingFace exports "
            f"(actor_rollout_ref.actor.checkpoint.save_contents={cfg.actor_rollout_ref.actor.checkpoint.save_contents}), "
            f"which never replace a checkpoint: choose another trainer.default_local_dir or move them")


def _plain_inflight(inflight) -> Optional[dict]:
    """The one-step-off generation in flight, (prompt indices, RolloutOutput or multi-turn
    (samples, prompt indices, turn metrics), policy version), as tensors and plain types (a
    checkpoint is read with torch.load(weights_only=True))."""
    if inflight is None:
        return None
    indices, out, version = inflight
    plain = {"indices": [int(i) for i in indices], "version": int(version)}
    if isinstance(out, tuple):   # conversations with tool turns
        samples, index, metrics = out
        plain["turns"] = {"samples": [dataclasses.asdict(x) for x in samples], "index": [int(i) for i in index],
                          "metrics": {k: float(v) for k, v in metrics.items()}}
    else:
        plain["output"] = dataclasses.asdict(out)
    return plain


def _inflight_from(plain: Optional[dict]):
    from megappo.rollout import MultiTurnSample, RolloutOutput

    if plain is None:
        return None
    if "turns" in plain:
        t = plain["turns"]
        out = ([MultiTurnSample(**x) for x in t["samples"]], t["index"], t["metrics"])
    else:
        out = RolloutOutput(**plain["output"])
    return plain["indices"], out, plain["version"]


@watchdog.in_phase("load_checkpoint", watchdog.SLOW)
def resume(cfg, workers_fn, sampler, algo_state: dict, logger, world: int, one_step_off: bool,
           replay=None, layout=None) -> Resumed:
    """Load the checkpoint ``trainer.resume_mode`` asks for (``workers_fn()``: the workers to
    load into); a run that died before its first checkpoint starts over (its metric lines dropped).
    ``replay`` (the critic's) gets this rank's rows back where the run's ``layout`` is the saved
    one (each DP rank holds its own rows, and every rank of a model replica must hold the same);
    under another layout, or from a checkpoint without them, it starts empty."""
    from megappo.checkpoint import CheckpointError, latest_step, load_checkpoint, read_rank_state

    tr = cfg.trainer
    root = os.path.expanduser(tr.default_local_dir)
    if tr.resume_mode == "disable":
        return Resumed(None)
    if tr.resume_mode == "auto":
        step = latest_step(root)
        if step is None:
            logger.truncate_after(-1)
            return Resumed(None)
        path = os.path.join(root, f"global_step_{step}")
    else:
        path = os.path.expanduser(tr.resume_from_path if tr.resume_mode == "resume_path" else tr.resume_mode)
    state, rank_state = load_checkpoint(path, workers_fn(), with_rank_state=True)
    try:
        sampler.load_state_dict(state["data"])
        for name, obj in algo_state.items():
            # group_cv's sums are newer than the format: a checkpoint without them starts them at 0
            if name in state or name == "kl_ctrl":
                obj.load_state_dict(state[name])
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{path}/trainer_state.json: cannot restore the trainer state: {e}") from e
    step = int(state["step"])
    if rank_state is not None and state.get("world_size") == world:
        rng.restore(rank_state)
        same_layout = layout is not None and state.get("layout") == json.loads(json.dumps(dataclasses.asdict(layout)))
        if replay is not None and same_layout and "critic_replay" in rank_state:
            replay.load_state_dict(rank_state["critic_replay"])
    inflight = None
    if one_step_off:
        # the generation in flight at the save (the next step's batch) was stored with it:
        # the resumed run trains on exactly what the uninterrupted one trained on
        inflight = _inflight_from((read_rank_state(path, 0) or {}).get("inflight"))
    logger.truncate_after(step)
    return Resumed(path, step, inflight)
