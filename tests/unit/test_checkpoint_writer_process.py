"""megatron's async file writer starts a spawned Manager process at its first save and keeps it
for the life of the process; ``end_writer_process`` ends it (a test session or a notebook that
saved a checkpoint would otherwise carry a ~0.5 GB process to its exit)."""
import pytest


def test_end_writer_process_ends_megatron_writer_manager():
    psutil = pytest.importorskip("psutil")
    from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

    from megappo.checkpoint import end_writer_process

    me = psutil.Process()
    before = {p.pid for p in me.children()}
    assert fa._results_queue is None
    fa._get_write_results_queue()          # what megatron's writer does at its first save
    # (a first spawn also starts multiprocessing's resource tracker, shared by the whole process)
    new = [p for p in me.children() if p.pid not in before and "spawn_main" in " ".join(p.cmdline())]
    assert new, "megatron's results queue started no process"
    assert end_writer_process() is True
    gone, alive = psutil.wait_procs(new, timeout=20)
    assert not alive, f"still running: {[p.pid for p in alive]}"
    assert fa._results_queue is None
    assert end_writer_process() is False   # nothing left to end; a later save starts a new one
