"""Run a function on N gloo processes (torch.multiprocessing, forked from a forkserver with the heavy
imports done) and surface the first failure."""
import datetime
import faulthandler
import os
import socket
import sys

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks are forked from a forkserver that has imported these already: each rank of a spawned
# world saves their import (~15 s of CPU per rank under load: megatron.core ~8 s, vllm ~6 s).
PRELOAD = ("torch", "torch.distributed", "transformers", "megatron.core", "megatron.core.models.gpt",
           "megatron.core.pipeline_parallel", "megatron.core.optimizer", "vllm", "vllm.entrypoints.llm",
           # what a CPU engine's start imports (0.45 s of each engine's start; not its CPU worker,
           # whose import swaps torch.cuda's streams for placeholders: a trainer installs megappo's
           # shim first, tests/distributed/test_megatron_cpu.py checks that order) ...
           "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.model_loader",
           "vllm.model_executor.models.qwen3", "vllm.lora.worker_manager",
           "vllm.model_executor.layers.quantization.online.base", "vllm.entrypoints.launchers.cli_args",
           # ... and a trainer's (~1 s of CPU a rank: its data, its model's layer spec and rope)
           "pyarrow.parquet", "pyarrow.dataset", "megatron.core.models.gpt.gpt_layer_specs",
           "megatron.core.dist_checkpointing", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe",
           "transformers.models.llama.modeling_llama", "megappo.trainer", "megappo.workers", "megappo.config")
# After a rank fails: how long the others get to end before SIGTERM, and then before SIGKILL
# (torch's default, 30 s each, is spent in full on a rank that is stopped or ignores SIGTERM).
GRACE_S = 5.0


def forkserver():
    """The forkserver context, its server started (with :data:`PRELOAD` imported) before the
    first world: it lives as long as the test session and is not one of a world's leftovers."""
    import multiprocessing
    from multiprocessing import forkserver as fs

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    fs.ensure_running()
    return ctx


def forkserver_pid():
    from multiprocessing import forkserver as fs

    return getattr(fs._forkserver, "_forkserver_pid", None)


def _stdio_of(pid: int) -> None:
    """Write stdout and stderr where process ``pid``'s go now (appending): a forked rank inherits
    the forkserver's, which are those of the test that started it (pytest's capture of it)."""
    for fd in (1, 2):
        sys.stdout.flush() if fd == 1 else sys.stderr.flush()
        target = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)


def _entry(rank, world, port, fn, args, env=None, parent=None):
    if parent is not None:
        _stdio_of(parent)
    faulthandler.dump_traceback_later(240, exit=True)  # a hung collective kills the worker, not CI
    if env is not None:   # the test's environment now (the forkserver's is that of its start)
        os.environ.clear()
        os.environ.update(env)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from processes import die_with_parent

    die_with_parent()   # a killed test session takes its ranks along
    # what torchrun provides (vLLM's external launcher reads them)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        fn(rank, world, *args)
        if dist.is_initialized():  # a vLLM engine's shutdown may already have ended the world
            dist.barrier()
    finally:
        # vLLM destroys its own groups at exit and fails if the world is already gone: leave it then.
        if dist.is_initialized() and "vllm" not in sys.modules:
            dist.destroy_process_group()


def spawn(fn, world: int, *args) -> None:
    """Call ``fn(rank, world, *args)`` in ``world`` processes; raise if any of them fails. Whatever
    the ranks started and left running (a rank killed mid-run orphans its children, which the
    test session's subreaper inherits) is ended when they are done."""
    # Children import this module and the test module by name: make their folder importable.
    here = os.path.dirname(os.path.abspath(__file__))
    for folder in (here, os.path.dirname(here)):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    from processes import descendants, end_new_descendants

    forkserver()
    before = {p.pid for p in descendants()}
    try:
        ranks = mp.start_processes(_entry, args=(world, free_port(), fn, args, dict(os.environ), os.getpid()), nprocs=world,
                                   join=False, start_method="forkserver")
        while not ranks.join(grace_period=GRACE_S):
            pass
    finally:
        end_new_descendants(before)


def _each(rank, world, calls):
    import traceback

    for fn, args, error_file in calls:
        try:
            fn(rank, world, *args)
        except Exception:
            with open(f"{error_file}.rank{rank}", "w") as f:
                f.write(traceback.format_exc())


def spawn_each(world: int, calls) -> None:
    """Run several ``(fn, args, error_file)`` calls one after another in ONE world of ``world``
    processes (a spawned world costs seconds of imports; tests that can share one should). A call
    that raises writes its traceback to ``error_file.rank<r>`` and the next call runs; read it back
    with :func:`raise_if_failed`. Each call sets up its own parallel state (``mcore.setup`` resets
    megatron's). A call that fails on some ranks only can leave the others in a collective: share
    multi-rank worlds only between calls that fail everywhere or nowhere."""
    spawn(_each, world, list(calls))


def raise_if_failed(error_file) -> None:
    """Fail the calling test with the traceback a :func:`spawn_each` call left, if any."""
    import glob

    import pytest

    for path in sorted(glob.glob(f"{error_file}.rank*")):
        with open(path) as f:
            pytest.fail(f"{os.path.basename(path)}:\n{f.read()}", pytrace=False)
