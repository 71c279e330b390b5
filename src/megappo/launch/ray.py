"""Ray launcher: ``python -m megappo.launch.ray [--address ADDR] [--nnodes N] [--nproc-per-node P]
[--device cuda|cpu] -- <megappo.train arguments>``.

Reserves one bundle per rank (a GPU, or a CPU on CPU runs) in a placement group spread over the
nodes, orders the bundles node by node so that each node holds consecutive ranks (tensor-parallel
groups stay inside a node), and starts one actor per bundle. Each actor runs ``python -m
megappo.train`` as a child process with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus what launch/common.sh exports for GPU ranks (see
:func:`rank_env`); its output reaches the driver through Ray's log streaming. The first rank to
fail stops the whole job: the driver names the rank, its exit status and the error it reported
(ranks that fail after it, in collectives with the rank that left, are listed as such), stops
every other rank's process and exits non-zero; nothing is left running.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Optional

__all__ = ["main", "rank_plan", "rank_env"]


def rank_plan(bundle_nodes: list[str], node_ips: dict[str, str]) -> list[dict]:
    """One entry per rank: bundle index, node IP, LOCAL_RANK and node rank. Ranks fill the nodes
    in the order they first appear among the bundles, consecutively within a node."""
    order = list(dict.fromkeys(bundle_nodes))
    plan = []
    for node_rank, node in enumerate(order):
        local = [b for b, n in enumerate(bundle_nodes) if n == node]
        for local_rank, bundle in enumerate(local):
            plan.append({"bundle": bundle, "ip": node_ips[node], "local_rank": local_rank,
                         "local_world": len(local), "node_rank": node_rank})
    return plan


# PyTorch's allocator for the trainer on GPU: expandable segments grow and shrink in place, so
# megatron's micro-batches of varying length do not fragment memory next to vLLM's pool (vLLM's
# sleep-mode allocator turns them off around its own pool, vllm/device_allocator/cumem.py).
ALLOC_CONF = "expandable_segments:True"


def rank_env(rank: int, entry: dict, world: int, master_ip: str, master_port: int, device: str) -> dict:
    """The variables a rank's trainer process gets over its actor's environment (they win): what
    torchrun gives a rank, and on GPU what launch/common.sh exports for the torchrun/SLURM paths.
    ``entry`` is the rank's item of :func:`rank_plan`."""
    env = {"RANK": str(rank), "LOCAL_RANK": str(entry["local_rank"]), "WORLD_SIZE": str(world),
           "LOCAL_WORLD_SIZE": str(entry["local_world"]), "GROUP_RANK": str(entry["node_rank"]),
           "MASTER_ADDR": master_ip, "MASTER_PORT": str(master_port), "MEGAPPO_RAY_DEVICE": device}
    if device == "cuda":
        # megatron overlaps TP/SP communication with compute only when kernels are issued in order.
        # Set, not defaulted, as common.sh does: Ray workers do not inherit the driver's shell, and
        # megatron's overlap is built for this value.
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
        # the training side's allocator (see launch/common.sh): the driver's own setting, if any
        env["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    return env


def _parse(argv) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        own, train = argv[:i], argv[i + 1:]
    else:
        own, train = argv, []
    p = argparse.ArgumentParser(prog="python -m megappo.launch.ray", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                   help="Ray cluster to join (default: RAY_ADDRESS, else start a local one)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes the job spans (bundles are spread over them)")
    p.add_argument("--nproc-per-node", type=int, default=8, help="ranks per node (GPUs; processes on CPU)")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="what a bundle reserves; default: the job's trainer.device")
    p.add_argument("--cpus-per-rank", type=float, default=None, help="CPUs a bundle reserves (default 1; GPU runs 4)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds to wait for the placement group")
    args = p.parse_args(own)
    if args.nnodes < 1 or args.nproc_per_node < 1:
        p.error(f"--nnodes ({args.nnodes}) and --nproc-per-node ({args.nproc_per_node}) must be >= 1")
    # Resolve the job's configuration here, before reserving anything: a broken config fails in
    # seconds on the driver instead of on every rank; the device decides what a bundle holds.
    from megappo.config import ConfigError, load_config, validate
    from megappo.train import parse_args

    targs = parse_args(train)
    try:
        cfg = load_config(targs.overrides, targs.config or [])
        validate(cfg, check_paths=False)  # files are checked on the ranks' nodes
    except ConfigError as e:
        p.exit(2, f"megappo ray: invalid configuration, nothing was started.\n{e}\n")
    from megappo.layout import parallel_layout

    world = parallel_layout(cfg).world_size   # the split placement's rollout ranks included
    if world != args.nnodes * args.nproc_per_node:
        what = ("trainer.nnodes x trainer.n_gpus_per_node" if cfg.actor_rollout_ref.hybrid_engine else
                "trainer.nnodes x trainer.n_gpus_per_node + rollout.nnodes x rollout.n_gpus_per_node")
        p.exit(2, f"megappo ray: {what} = {world}, but --nnodes {args.nnodes} x "
                  f"--nproc-per-node {args.nproc_per_node} = {args.nnodes * args.nproc_per_node} ranks\n")
    if args.device is None:
        args.device = cfg.trainer.device
    return args, train


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _set_pdeathsig() -> None:
    """In the child: die with the actor (Linux), so a killed actor leaves no orphan trainer."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _make_rank_actor():
    import ray

    @ray.remote(max_concurrency=2)  # stop() must run while run() waits on the child
    class RankActor:
        def __init__(self):
            self.proc: Optional[subprocess.Popen] = None

        def node(self) -> tuple[str, int]:
            return ray.util.get_node_ip_address(), _free_port()

        def run(self, env: dict, argv: list[str]) -> dict:
            """Run the rank to its end: exit code, when it failed (its own report, else when it
            died) and the error it reported."""
            import json
            import tempfile

            fd, report = tempfile.mkstemp(prefix="megappo-failure-", suffix=".json")
            os.close(fd)
            full = dict(os.environ, **env, MEGAPPO_FAILURE_FILE=report)
            if env.get("MEGAPPO_RAY_DEVICE") == "cuda":
                # Ray sets CUDA_VISIBLE_DEVICES to this bundle's GPU; every rank of a node must
                # see all of the node's GPUs and pick LOCAL_RANK's (as under torchrun).
                full.pop("CUDA_VISIBLE_DEVICES", None)
            try:
                self.proc = subprocess.Popen([sys.executable, "-m", "megappo.train", *argv], env=full,
                                             preexec_fn=_set_pdeathsig, start_new_session=True)
                code = self.proc.wait()
                out = {"code": code, "time": time.time(), "error": ""}
                try:
                    with open(report) as f:
                        out.update({k: v for k, v in json.load(f).items() if k in ("time", "error")})
                except (OSError, ValueError):
                    pass  # killed, or failed before it could report
                return out
            finally:
                os.unlink(report)

        def stop(self) -> None:
            if self.proc is not None and self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGTERM)
                try:
                    self.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(self.proc.pid, signal.SIGKILL)

    return RankActor


FAILURE_GRACE_S = 3.0


def _outcome(ray, ref, rank: int) -> dict:
    try:
        out = dict(ray.get(ref))
        out["why"] = _describe_exit(out["code"])
    except Exception as e:  # the actor itself died (node lost, OOM kill)
        out = {"code": 1, "time": time.time(), "error": "", "why": f"lost its actor: {type(e).__name__}: {e}"}
    out["rank"] = rank
    return out


def sort_failures(failed: list[dict]) -> list[dict]:
    """Failed ranks, the cause first. A rank killed by a signal is the cause and its peers'
    collective errors the consequence, even when a peer's own report carries the earlier time
    (the killed rank's time is when its actor saw it die: later under load); otherwise the
    earliest failure."""
    return sorted(failed, key=lambda o: (o["code"] >= 0, o["time"]))


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def main(argv=None) -> int:
    args, train = _parse(list(sys.argv[1:] if argv is None else argv))
    import ray
    from ray.util.placement_group import placement_group, placement_group_table
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    world = args.nnodes * args.nproc_per_node
    ray.init(address=args.address, log_to_driver=True)
    cpus = args.cpus_per_rank if args.cpus_per_rank is not None else (1.0 if args.device == "cpu" else 4.0)
    bundle = {"CPU": cpus, **({"GPU": 1.0} if args.device == "cuda" else {})}
    # SPREAD would interleave ranks of different nodes; PACK fills node after node, and the
    # plan below orders ranks by node either way.
    pg = placement_group([dict(bundle) for _ in range(world)], strategy="PACK" if args.nnodes > 1 else "STRICT_PACK")
    ready, _ = ray.wait([pg.ready()], timeout=args.start_timeout)
    if not ready:
        print(f"megappo ray: the cluster cannot place {world} bundles of {bundle} within {args.start_timeout:.0f} s "
              f"(--nnodes {args.nnodes} x --nproc-per-node {args.nproc_per_node}); available: "
              f"{ray.available_resources()}", file=sys.stderr)
        ray.shutdown()
        return 2
    table = placement_group_table(pg)["bundles_to_node_id"]
    bundle_nodes = [table[i] for i in range(world)]
    nodes_used = len(set(bundle_nodes))
    if nodes_used != args.nnodes:
        print(f"megappo ray: the {world} bundles landed on {nodes_used} node(s), expected --nnodes {args.nnodes}",
              file=sys.stderr)
        ray.shutdown()
        return 2
    node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    plan = rank_plan(bundle_nodes, node_ips)
    RankActor = _make_rank_actor()
    actors = [RankActor.options(num_cpus=cpus, num_gpus=1 if args.device == "cuda" else 0,
                                scheduling_strategy=PlacementGroupSchedulingStrategy(
                                    placement_group=pg, placement_group_bundle_index=p["bundle"])).remote()
              for p in plan]
    master_ip, master_port = ray.get(actors[0].node.remote())
    refs = {}
    for rank, (actor, p) in enumerate(zip(actors, plan)):
        env = rank_env(rank, p, world, master_ip, master_port, args.device)
        refs[actor.run.remote(env, train)] = rank
    print(f"megappo ray: {world} ranks on {nodes_used} node(s), master {master_ip}:{master_port}", flush=True)
    status = 0
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            first = _outcome(ray, done[0], refs[done[0]])
            if first["code"] != 0:
                # The other ranks fail moments later in collectives with the rank that left, and
                # may be reaped first: collect them briefly and name the earliest failure.
                more, pending = ray.wait(pending, num_returns=len(pending), timeout=FAILURE_GRACE_S)
                failed = sort_failures([first] + [o for o in (_outcome(ray, r, refs[r]) for r in more) if o["code"] != 0])
                cause = failed[0]
                print(f"megappo ray: rank {cause['rank']} {cause['why']}"
                      f"{': ' + cause['error'] if cause['error'] else ''}; stopping the other "
                      f"{len(refs) - 1} rank(s)", file=sys.stderr, flush=True)
                if len(failed) > 1:
                    print("megappo ray: failed after it: " + ", ".join(f"rank {o['rank']} ({o['why']})" for o in failed[1:]),
                          file=sys.stderr, flush=True)
                code = cause["code"]
                status = code if 0 < code < 256 else 1
                break
    except KeyboardInterrupt:
        status = 130
    finally:
        if pending or status:
            stops = [a.stop.remote() for a in actors]
            for ref in stops:
                try:
                    ray.get(ref, timeout=60)
                except Exception:  # noqa: BLE001 - a dead actor's child died with it (PDEATHSIG)
                    pass
        for a in actors:
            ray.kill(a)
        ray.util.remove_placement_group(pg)
        time.sleep(0.5)  # let log streaming flush the ranks' last lines
        ray.shutdown()
    return status


if __name__ == "__main__":
    sys.exit(main())
