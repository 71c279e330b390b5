"""Entry point: ``python -m megappo.train [--config FILE_OR_PRESET ...] [--dry-run] key=value ...``

config -> validate -> (init -> build -> fit). Every rank runs this same program.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from megappo.layout import parallel_layout
from megappo.config import (ConfigError, PPOConfig, all_keys, load_config, source_of, to_yaml,
                            validate)



VERL_CONFIG_NAMES = {"ppo_megatron_trainer", "ppo_trainer"}
# verl's example configs (``--config-name`` under the example's ``--config-path``): the file itself
# where it is there (its Hydra header read: defaults = verl's trainer config), else, for the
# examples megappo knows, verl's trainer defaults with megappo/presets/verl/<name>.yaml; applied
# before --config files.
VERL_EXAMPLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets", "verl")
VERL_EXAMPLE_CONFIGS = {"gsm8k_multiturn_megatron_grpo"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m megappo.train",
        description="Megatron-backed PPO trainer. Overrides use verl's key paths: a.b.c=value.",
    )
    p.add_argument("--config", action="append", default=None, metavar="FILE_OR_PRESET",
                   help="YAML file or built-in preset name (e.g. tiny_cpu), applied in order over verl's defaults")
    p.add_argument("--dry-run", action="store_true",
                   help="validate (all rules but the existence of data/model paths), print the resolved config and exit")
    # verl's hydra flags, so a verl command line runs unchanged: its two trainer configs are
    # verl's defaults, which megappo's own defaults already are.
    p.add_argument("--config-path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--config-name", default=None, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", metavar="key=value")
    return p.parse_args(argv)


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def build_config(args: argparse.Namespace) -> tuple[PPOConfig, list[str]]:
    """Load and validate; raise one ConfigError holding every problem found."""
    errors: list[tuple[str, str]] = []
    sources: dict = {}
    warnings: list[str] = []
    name = None if args.config_name is None else args.config_name.removesuffix(".yaml")
    files = list(args.config or [])
    own = (os.path.join(os.path.expanduser(args.config_path), f"{name}.yaml")
           if name is not None and args.config_path and name not in VERL_CONFIG_NAMES else None)
    if own is not None and os.path.isfile(own):   # the command's own verl config file, read as verl's
        files.insert(0, own)
    elif name in VERL_EXAMPLE_CONFIGS:
        files.insert(0, os.path.join(VERL_EXAMPLE_DIR, f"{name}.yaml"))
    elif name is not None and name not in VERL_CONFIG_NAMES:
        where = f"no {own} and " if own is not None else ""
        errors.append(("--config-name", f"{where}{args.config_name!r} is not one of verl's trainer configs "
                                        f"{sorted(VERL_CONFIG_NAMES)} nor of its example configs megappo knows "
                                        f"{sorted(VERL_EXAMPLE_CONFIGS)}; pass your own YAML with --config"))
    cfg = load_config(args.overrides, files, raise_errors=False, errors=errors, sources=sources,
                      warnings=warnings)
    if not args.dry_run:
        _resolve_hub_ids(cfg, errors)
    world = os.environ.get("WORLD_SIZE")
    try:
        validate(cfg, check_paths=not args.dry_run, world_size=None if args.dry_run or world is None else int(world),
                 warnings=warnings)
    except ConfigError as e:
        # Keys that failed to parse keep their defaults; don't report those twice.
        bad = {k for k, _ in errors}
        errors += [(k, f"{m} [value from {source_of(sources, k)}]" if k in all_keys() else m)
                   for k, m in e.errors if k not in bad]
    if not errors:
        errors += _layout_errors(cfg)
    if errors:
        raise ConfigError(errors)
    return cfg, warnings


def _layout_errors(cfg: PPOConfig) -> list:
    """A layout the model cannot be built at (TP not dividing its heads, layers not divisible by
    PP x VPP, experts by EP), named before anything starts -- also in a dry run -- when the
    model's config.json can be read (a folder, the hub cache, or a shipped config of that name)."""
    from megappo import hub, plan

    source = cfg.actor_rollout_ref.model.path
    try:
        path = plan.find_model_config(source)
        shape = plan.model_shape(json.loads(path.read_text()), name=path.parent.name)
    except (FileNotFoundError, OSError, ValueError, KeyError, hub.HubError):
        return []   # not readable here (a path on the cluster): the model's build checks it later
    problems = plan.layout_problems(shape, plan.options_from_config(cfg, gpu_memory_gb=80.0))
    return [("actor_rollout_ref.actor.megatron", f"the layout cannot be built for {source}: " + "; ".join(problems))
            ] if problems else []


MODEL_PATH_KEYS = ("actor_rollout_ref.model.path", "critic.model.path", "reward_model.model.path")


def _resolve_hub_ids(cfg: PPOConfig, errors: list) -> None:
    """Hub ids among the model paths become their local snapshot (downloaded once per node, see
    megappo.hub); one that cannot be had is an error naming it, before anything starts."""
    from megappo import hub
    from megappo.config import get

    from megappo.config import critic_enabled

    used = {"actor_rollout_ref.model.path": True, "critic.model.path": critic_enabled(cfg),
            "reward_model.model.path": cfg.reward_model.enable}
    for key in MODEL_PATH_KEYS:
        if not used[key]:
            continue
        section, _, name = key.rpartition(".")
        value = get(cfg, key)
        if isinstance(value, str) and hub.is_hub_id(value):
            try:
                setattr(get(cfg, section), name, hub.resolve(value))
            except hub.HubError as e:
                errors.append((key, str(e)))


def describe_layout(cfg: PPOConfig) -> str:
    lay = parallel_layout(cfg)
    vpp = (f" VPP={lay.vpp}" if lay.vpp else "") + (f" CP={lay.cp}" if lay.cp > 1 else "")
    ep = cfg.actor_rollout_ref.actor.megatron.expert_model_parallel_size
    tr, ro = cfg.trainer, cfg.rollout
    if lay.split:   # two groups of ranks: say where each sits and how it is laid out
        where = ("the last " if ro.nnodes == tr.nnodes else "own nodes, ") + f"{ro.n_gpus_per_node} per node"
        return (f"world={lay.world_size} (split: {lay.train_world} training ranks on {tr.nnodes} node(s) x "
                f"{tr.n_gpus_per_node} + {lay.rollout_world} rollout ranks, {where}) | "
                f"train: TP={lay.tp} PP={lay.pp}{vpp} DP={lay.dp}{f' EP={ep}' if ep > 1 else ''} | "
                f"rollout: TP={lay.rollout_tp} DP={lay.rollout_dp} | {tr.async_mode} | device={tr.device}")
    return (f"world={lay.world_size} ({tr.nnodes} node(s) x {tr.n_gpus_per_node}) | "
            f"train: TP={lay.tp} PP={lay.pp}{vpp} DP={lay.dp}{f' EP={ep}' if ep > 1 else ''} | rollout: TP={lay.rollout_tp} DP={lay.rollout_dp} | "
            f"device={tr.device}")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        cfg, warnings = build_config(args)
    except ConfigError as e:
        print(f"megappo: invalid configuration, nothing was started.\n{e}", file=sys.stderr)
        return 2
    if _is_rank0():
        for w in warnings:
            print(f"megappo: warning: {w}", file=sys.stderr)
        print("# resolved configuration")
        print(to_yaml(cfg), end="")
        print(f"# layout: {describe_layout(cfg)}")
    if args.dry_run:
        return 0
    if "RANK" not in os.environ:  # no launcher
        world = parallel_layout(cfg).world_size
        if world != 1:
            print(f"megappo: this configuration runs {world} processes (trainer.nnodes x trainer.n_gpus_per_node = "
                  f"{cfg.trainer.nnodes} x {cfg.trainer.n_gpus_per_node}"
                  f"{'' if cfg.actor_rollout_ref.hybrid_engine else ', plus the rollout ranks of the split placement'}); "
                  "start it with a launcher: "
                  f"torchrun --nproc_per_node {cfg.trainer.n_gpus_per_node} -m megappo.train ..., or launch/*.sh",
                  file=sys.stderr)
            return 2
        _single_process_env()
    from megappo.trainer import PPOTrainer, init_distributed

    try:
        init_distributed(cfg)
        from megappo.distributed import split

        groups = split.current()
        if groups is not None and groups.role == "rollout":   # the split placement's rollout ranks
            from megappo.trainer import serve

            serve(cfg, groups)
        else:
            PPOTrainer(cfg).fit()
    except BaseException as e:
        # One line naming the rank before the traceback: with hundreds of ranks, the first
        # failure is the one to read (torchrun's summary and the Ray launcher point at it).
        if not isinstance(e, SystemExit) or e.code not in (0, None):
            print(f"megappo: rank {os.environ.get('RANK', '0')} failed: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
            _report_failure(e)
        raise
    return 0


def _single_process_env() -> None:
    """What torchrun would give the one process of a world of one, with port 0 for its store: the
    store binds a port the system picks as it binds. A port found free first and bound later
    could be taken in between (two such runs started together failed with EADDRINUSE, 2026-12-06);
    nobody else connects to a world of one (its watchdog is off, world < 2)."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="0")


def _report_failure(e: BaseException) -> None:
    """For a launcher that names the first failure (the Ray launcher sets MEGAPPO_FAILURE_FILE):
    when this rank failed and why. When one rank fails, the others then fail too, in collectives
    with the rank that left; the failure times tell the cause from its consequences."""
    path = os.environ.get("MEGAPPO_FAILURE_FILE")
    if not path:
        return
    import json
    import time

    try:
        with open(path, "w") as f:
            json.dump({"time": time.time(), "error": f"{type(e).__name__}: {e}"[:500]}, f)
    except OSError:
        pass


if __name__ == "__main__":
    sys.exit(main())
