"""megatron's file writer hands its write results back through a queue it makes once per process:
a ``multiprocessing`` Manager's (a spawned server that imports torch at the first save and holds
~0.5 GB for the life of the process). megappo's saves are synchronous and give it a plain
in-process queue instead (``in_process_write_results``); ``end_writer_process`` ends a Manager
that megatron started anyway (a test session or a notebook would otherwise carry it to its exit)."""
import queue
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny_models import save_tiny_model  # noqa: E402


@pytest.fixture
def writer_queue():
    """megatron's module-level queue, reset to 'not made yet' for the test and restored after."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    saved, fa._results_queue = fa._results_queue, None
    yield fa
    fa._results_queue = saved


def _spawned_children(psutil, before):
    return [p for p in psutil.Process().children() if p.pid not in before and "spawn_main" in " ".join(p.cmdline())]


def test_end_writer_process_ends_megatron_writer_manager(writer_queue):
    psutil = pytest.importorskip("psutil")
    from megappo.checkpoint import end_writer_process

    fa = writer_queue
    before = {p.pid for p in psutil.Process().children()}
    fa._get_write_results_queue()          # what megatron's writer does at its first save
    # (a first spawn also starts multiprocessing's resource tracker, shared by the whole process)
    new = _spawned_children(psutil, before)
    assert new, "megatron's results queue started no process"
    assert end_writer_process() is True
    gone, alive = psutil.wait_procs(new, timeout=20)
    assert not alive, f"still running: {[p.pid for p in alive]}"
    assert fa._results_queue is None
    assert end_writer_process() is False   # nothing left to end; a later save starts a new one


def test_a_save_starts_no_results_server_and_completes(writer_queue, tmp_path):
    """A synchronous save (here the HF importer's, the same dist_checkpointing.save the trainer's
    save_worker calls) runs with a plain queue: no process started, and the checkpoint's
    metadata -- written only after the write results came back through the queue -- lists
    every tensor of the model."""
    psutil = pytest.importorskip("psutil")
    from megappo.convert.hf_export import import_hf
    from megappo.convert.megatron_ckpt import CheckpointKeys, checkpoint_tensors
    from megappo.convert.names import param_maps
    from megappo.models import describe, load_hf_config

    fa = writer_queue
    save_tiny_model("qwen3", tmp_path / "hf")
    before = {p.pid for p in psutil.Process().children()}
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), progress=False)
    assert type(fa._results_queue) is queue.Queue and fa._results_queue.empty()
    assert not _spawned_children(psutil, before)
    desc = describe(load_hf_config(str(tmp_path / "hf"))).desc
    saved = checkpoint_tensors(str(tmp_path / "ckpt"))
    keys = CheckpointKeys(saved)
    want = {keys.key(pm): keys.shape(pm, desc) for pm in param_maps(desc, te=False)}
    assert {k: saved[k][0] for k in want if k in saved} == want, sorted(saved)
