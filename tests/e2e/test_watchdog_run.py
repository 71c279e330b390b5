"""A stuck rank ends the job in the configured silence, named, and the last checkpoint stays
published: a 2-rank run where one rank SIGSTOPs itself in step 2's actor update. Rank 1 stopped:
rank 0's watchdog sees its beat stand still. Rank 0 stopped: it hosts the job's store here (as
under srun and the Ray launcher), so rank 1 sees the store stop answering -- its client calls
then block, and only the watchdog's guard thread can end the job."""
import os
import re
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))
sys.path.insert(0, str(REPO / "tests" / "e2e"))

SILENCE = 20


def _until_published(phase: str, limit_s: float = 60.0) -> None:
    """Wait until this rank's beat in the job's store names ``phase`` (its watchdog thread writes
    it when the phase starts, when that thread gets the CPU) and every other rank has read it: a
    watcher's round sets its own beat, then reads; two new beats of each other rank mean a whole
    round of its after ours was published."""
    from megappo import watchdog

    w = watchdog._current
    store = w.connect()

    def beat(r):
        key = f"{w.prefix}{r}"
        return store.get(key).decode().split("|") if store.check([key]) else ["-1", ""]

    deadline = time.time() + limit_s
    while beat(w.rank)[1] != phase:
        assert time.time() < deadline, f"phase {phase} not published in {limit_s:.0f} s"
        time.sleep(0.1)
    others = {r: int(beat(r)[0]) for r in range(w.world) if r != w.rank}
    while any(int(beat(r)[0]) < n + 2 for r, n in others.items()):
        assert time.time() < deadline, f"phase {phase} not read by the other ranks in {limit_s:.0f} s"
        time.sleep(0.1)


def _stop_in_update(rank, world, setup, run_dir, stop_rank, at_step):
    from test_resume import _run

    from megappo.trainer import phases

    if rank == stop_rank:
        original, calls = phases.update_actor, []

        def update_actor(*args, **kwargs):
            calls.append(1)
            if len(calls) == at_step:
                _until_published("update_actor")   # the phase in the store, and read, before the stop
                Path(run_dir, "stopped_at").write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGSTOP)
            return original(*args, **kwargs)
        phases.update_actor = update_actor
    _run(rank, world, setup, run_dir, 3, ["trainer.save_freq=1", f"trainer.watchdog_silence_s={SILENCE}"])


@pytest.mark.e2e
@pytest.mark.parametrize("stopped", [1, 0])
def test_a_stopped_rank_ends_the_job_named_and_the_last_checkpoint_is_kept(tmp_path, capfd, stopped):
    from harness import spawn

    from megappo.data.tiny import make_tiny_setup

    setup = make_tiny_setup(str(tmp_path / "tiny"))
    run = tmp_path / "run"
    with pytest.raises(Exception):
        spawn(_stop_in_update, 2, setup, str(run), stopped, 2)
    ended = time.time()
    err = capfd.readouterr().err
    who = rf"rank {stopped} \(host {re.escape(socket.gethostname())}, pid (\d+)\) last in phase update_actor of step 2"
    if stopped:
        m = re.search(rf"megappo: {who}, silent for (\d+) s; ending the job", err)
    else:
        m = re.search(rf"megappo: rank 1: the job's store has not answered for (\d+) s[^;]*; {who}; ending the job", err)
    assert m, err[-3000:]
    pid, silent = (int(m.group(1)), int(m.group(2))) if stopped else (int(m.group(2)), int(m.group(1)))
    try:   # the harness ends what its world left; make sure of the stopped rank whatever it did
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    assert SILENCE <= silent <= SILENCE + 30
    # the stop to the spawn's return: the silence, the watchdog's interval, and the 30 s grace
    # torch.multiprocessing gives the survivors before SIGKILL (a launcher's own)
    assert ended - float((run / "stopped_at").read_text()) < SILENCE + 30 + 35
    assert (run / "latest").read_text() == "1" and (run / "global_step_1").is_dir()
    assert not (run / "global_step_2").exists() and not (run / ".tmp_global_step_2").exists()


def _engine_fails(rank, world, setup, run_dir, at_step):
    from test_resume import _run

    import torch
    import vllm

    from megappo import watchdog

    original = vllm.LLM.generate

    def generate(self, *args, **kwargs):
        if watchdog.current() == ("gen", at_step):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return original(self, *args, **kwargs)
    vllm.LLM.generate = generate
    _run(rank, world, setup, run_dir, 3, ["trainer.save_freq=1", f"trainer.n_gpus_per_node={world}"])


@pytest.mark.e2e
def test_an_engine_failing_in_generation_is_named_with_a_hint_and_no_checkpoint_is_published(tmp_path):
    from harness import spawn

    from megappo.data.tiny import make_tiny_setup

    setup = make_tiny_setup(str(tmp_path / "tiny"))
    run = tmp_path / "run"
    with pytest.raises(Exception) as e:
        spawn(_engine_fails, 1, setup, str(run), 2)
    msg = str(e.value)
    assert re.search(r"RolloutEngineError: step 2, phase gen: the rollout engine failed in generate: OutOfMemoryError: "
                     r"CUDA out of memory\. Tried to allocate 2\.00 GiB; it looks like memory: lower "
                     r"actor_rollout_ref\.rollout\.gpu_memory_utilization \(now [0-9.]+\)", msg), msg[-3000:]
    assert (run / "latest").read_text() == "1" and (run / "global_step_1").is_dir()
    assert not (run / "global_step_2").exists() and not (run / ".tmp_global_step_2").exists()


def _update_hangs(rank, world, setup, run_dir, at_step):
    import threading

    from test_resume import _run

    from megappo.trainer import phases

    if rank == 1:
        original, calls = phases.update_actor, []

        def update_actor(*args, **kwargs):
            calls.append(1)
            if len(calls) == at_step:
                Path(run_dir, "hung_at").write_text(str(time.time()))
                threading.Event().wait()   # a call that never returns and uses no CPU (a lost connection)
            return original(*args, **kwargs)
        phases.update_actor = update_actor
    _run(rank, world, setup, run_dir, 3, ["trainer.save_freq=1", f"trainer.watchdog_silence_s={SILENCE}"])


@pytest.mark.e2e
def test_a_hung_call_with_the_others_waiting_ends_the_job_named(tmp_path, capfd):
    """Every rank alive and beating, none computing: rank 1 in a call that never returns, rank 0
    waiting for it in the update's collective. Rank 0's watchdog ends the job after the silence."""
    from harness import spawn

    from megappo.data.tiny import make_tiny_setup

    setup = make_tiny_setup(str(tmp_path / "tiny"))
    run = tmp_path / "run"
    with pytest.raises(Exception):
        spawn(_update_hangs, 2, setup, str(run), 2)
    ended = time.time()
    err = capfd.readouterr().err
    m = re.search(r"megappo: every rank has been blocked for (\d+) s or more \(no rank is computing: a deadlocked "
                  r"collective or a hung call\): (.*); ending the job", err)
    assert m, err[-3000:]
    assert SILENCE <= int(m.group(1)) <= SILENCE + 30
    assert m.group(2) == "ranks 0, 1 in phase update_actor of step 2", m.group(2)
    assert ended - float((run / "hung_at").read_text()) < SILENCE + 30 + 35
    assert (run / "latest").read_text() == "1" and not (run / "global_step_2").exists()
