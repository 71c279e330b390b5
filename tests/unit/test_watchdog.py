"""The watchdog's judgement on a fake store and clock: who is silent, for how long, when it is no fault."""
import pytest

from megappo import watchdog
from megappo.watchdog import SLOW, USER, Watchdog


class FakeStore:
    def __init__(self):
        self.kv, self.down = {}, False

    def _up(self):
        if self.down:
            raise TimeoutError("store timed out")

    def set(self, k, v):
        self._up()
        self.kv[k] = v.encode()

    def get(self, k):
        self._up()
        return self.kv[k]

    def check(self, keys):
        self._up()
        return all(k in self.kv for k in keys)

    def multi_get(self, keys):
        self._up()
        return [self.kv[k] for k in keys]


class World:
    """``n`` ranks' watchdogs on one store and one clock; ``ended`` collects (rank, message)."""

    def __init__(self, n=3, silence=20, slow=100):
        self.t, self.store, self.ended = 0.0, FakeStore(), []
        self.blocked, self.moves = set(), 0   # ranks whose main thread stands still

        def connect():
            self.store._up()
            return self.store

        def activity(r):
            self.moves += 1   # a working main thread: another frame position, or CPU time used
            return (("wait", 0), 1.0) if r in self.blocked else (("work", self.moves), 1.0)
        self.dogs = [Watchdog(connect, r, n, silence, slow, interval=5, clock=lambda: self.t,
                              end=lambda m, r=r: self.ended.append((r, m)), activity=lambda r=r: activity(r))
                     for r in range(n)]

    def run(self, seconds, ranks=None, step=5):
        for _ in range(int(seconds / step)):
            self.t += step
            for d in self.dogs:
                if ranks is None or d.rank in ranks:
                    d.tick()


def test_healthy_ranks_are_left_alone():
    w = World()
    w.run(300)
    assert w.ended == []


def test_a_stopped_rank_is_named_with_its_phase_and_step_after_the_silence():
    w = World()
    w.run(10)
    watchdog.set_step(12)
    with watchdog.phase("update_actor"):
        w.dogs[2].tick()   # rank 2's last beat, in the update
    w.run(20, ranks={0, 1})
    assert w.ended == []   # not before the silence
    w.run(10, ranks={0, 1})
    assert len(w.ended) == 1 and w.ended[0][0] == 0   # rank 0 watches every rank, rank 1 only rank 0
    msg = w.ended[0][1]
    d = w.dogs[2]
    assert msg.startswith(f"megappo: rank 2 (host {d.host}, pid {d.pid}) last in phase update_actor of step 12, "
                          "silent for "), msg
    assert msg.endswith("s; ending the job")
    assert 20 < float(msg.split("silent for ")[1].split(" s")[0]) <= 30


def test_a_slow_phase_gets_its_allowance():
    w = World()
    w.run(10)
    with watchdog.phase("save_checkpoint", SLOW):
        w.dogs[1].tick()
    w.run(90, ranks={0, 2})
    assert w.ended == []
    w.run(20, ranks={0, 2})
    assert "rank 1" in w.ended[0][1] and "phase save_checkpoint" in w.ended[0][1]


def test_a_finished_rank_is_no_fault():
    w = World()
    w.run(10)
    w.dogs[1].finish()
    w.run(200, ranks={0, 2})
    assert w.ended == []


def test_rank_0_stopped_is_seen_by_the_others():
    w = World(n=2)
    w.run(10)
    with watchdog.phase("gen"):
        w.dogs[0].tick()
    w.run(40, ranks={1})
    assert [r for r, _ in w.ended] == [1] and "rank 0 (host" in w.ended[0][1] and "phase gen" in w.ended[0][1]


def test_a_store_that_stops_answering_ends_the_job_after_the_silence():
    w = World(n=2)
    w.run(10)
    w.store.down = True   # the store lived in rank 0's process, now stopped
    w.run(20, ranks={1})
    assert w.ended == []
    w.run(10, ranks={1})
    assert w.ended[0][0] == 1 and "the job's store has not answered for" in w.ended[0][1]
    assert "rank 0 (host" in w.ended[0][1]


def test_a_store_call_that_never_returns_is_judged_by_the_guard():
    w = World(n=2)
    w.run(10)
    d = w.dogs[1]   # its beat thread now blocked in a store call: only the guard runs
    w.t += 20
    d.judge_store(w.t)
    assert w.ended == []
    w.t += 5
    d.judge_store(w.t)
    assert w.ended[0][0] == 1 and "the job's store has not answered for 25 s; rank 0 (host" in w.ended[0][1]


def test_a_watcher_held_itself_judges_afresh():
    w = World()
    w.run(10)
    w.dogs[0].tick()   # rank 0 has seen every rank's latest beat
    w.t += 60          # every thread on the host held (a paused machine): rank 0 wakes first
    w.dogs[0].tick()
    assert w.ended == []   # the others' beats did not move, but nor could rank 0 see them move
    w.run(10)
    assert w.ended == []


def _until_ended(w, seconds, phases=None):
    """Rounds of 5 s (ranks 0, 2, 1 in ``phases[rank]``) until a verdict: the seconds it took."""
    start = w.t
    while not w.ended and w.t - start < seconds:
        w.t += 5
        for r in (0, 2, 1):
            with watchdog.phase((phases or {}).get(r, "update_actor")):
                w.dogs[r].tick()
    return w.t - start


def test_every_rank_blocked_ends_the_job_naming_the_odd_one_out_first():
    """Rank 1 hangs in the reward function; ranks 0 and 2 wait for it in a collective. All beat."""
    w = World()
    w.run(10)
    watchdog.set_step(7)
    w.blocked = {0, 1, 2}
    took = _until_ended(w, 200, {1: "reward"})
    assert 20 < took <= 20 + 3 * 5, took   # the silence, plus up to the beats' age
    assert [r for r, _ in w.ended] == [0], w.ended
    d1, msg = w.dogs[1], w.ended[0][1]
    assert msg.startswith("megappo: every rank has been blocked for 2"), msg
    assert msg.endswith(f"s or more (no rank is computing: a deadlocked collective or a hung call): rank 1 (host "
                        f"{d1.host}, pid {d1.pid}) in phase reward of step 7; ranks 0, 2 in phase update_actor of "
                        f"step 7; ending the job"), msg


@pytest.mark.parametrize("phase", ["update_actor", "start"])
def test_one_rank_computing_keeps_the_others_waiting_as_long_as_it_takes(phase):
    """The limit is the silence, or the slow allowance while the job is still starting."""
    w = World()
    phases = dict.fromkeys(range(3), phase)
    w.run(10)
    w.blocked = {0, 2}   # waiting for rank 1, which works (a long reward function, a big forward)
    assert _until_ended(w, 500, phases) == 500 and w.ended == []
    w.blocked = {0, 1, 2}   # now it stops working too
    limit = 100 if phase == "start" else 20
    assert limit < _until_ended(w, 500, phases) <= limit + 15
    assert [r for r, _ in w.ended] == [0] and "every rank has been blocked" in w.ended[0][1]


def test_blocked_in_a_slow_phase_gets_the_slow_allowance_and_a_silent_rank_is_named_as_silent():
    w = World()
    w.run(10)
    w.blocked = {0, 1, 2}
    with watchdog.phase("save_checkpoint", SLOW):
        took = _until_ended(w, 500, dict.fromkeys(range(3), "save_checkpoint"))
    assert 100 < took <= 115, took
    w = World()   # the reward function waiting on a pool or a remote sandbox: allowed the slow limit
    w.run(10)
    w.blocked = {0, 1, 2}
    with watchdog.phase("reward", USER):
        took = _until_ended(w, 500, dict.fromkeys(range(3), "reward"))
    assert 100 < took <= 115, took
    w = World()   # ... and a rank stopped there is still named after the plain silence
    w.run(10)
    with watchdog.phase("reward", USER):
        w.run(30, ranks={0, 1})
    assert len(w.ended) == 1 and w.ended[0][1].startswith("megappo: rank 2 (host"), w.ended
    w = World()
    w.run(10)
    w.blocked = {0, 1, 2}
    with watchdog.phase("update_actor"):
        w.run(30, ranks={0, 1})   # rank 2 silent (stopped), the others blocked on it: the silence names it
    assert len(w.ended) == 1 and w.ended[0][1].startswith("megappo: rank 2 (host"), w.ended


def test_the_main_thread_sampler_tells_a_blocked_thread_from_a_working_one():
    import threading
    import time

    from megappo.watchdog import main_thread_activity

    go, stop = threading.Event(), threading.Event()
    waiter = threading.Thread(target=go.wait)
    worker = threading.Thread(target=lambda: [sum(range(1000)) for _ in iter(stop.is_set, True)])
    waiter.start(), worker.start()
    try:
        time.sleep(0.2)
        wait, work = main_thread_activity(waiter), main_thread_activity(worker)
        w0, k0 = wait(), work()
        deadline = time.time() + 10   # a loaded machine gives the worker less of a core
        while work()[1] - k0[1] <= 0.05 and time.time() < deadline:
            time.sleep(0.1)
        assert work()[1] - k0[1] > 0.05   # CPU time used: working
        assert wait() == w0   # same frame and instruction, no CPU time: blocked
    finally:
        go.set(), stop.set()
        waiter.join(), worker.join()


def test_phases_nest_and_the_step_carries_through():
    watchdog.set_step(3)
    with watchdog.phase("step"):
        with watchdog.phase("update_actor"):
            assert watchdog.current() == ("update_actor", 3)
            watchdog.set_step(4)
        assert watchdog.current() == ("step", 4)


def test_disabled_or_alone_starts_nothing(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert watchdog.start(0, 2, 0, 100) is None
    assert watchdog.start(0, 1, 20, 100) is None


def test_an_engine_failure_names_the_phase_and_hints_at_memory_only_for_memory():
    from megappo.rollout.engine import RolloutEngineError, _named_failures

    class Engine:
        gpu_memory_utilization = 0.6

        @_named_failures("its wake-up")
        def wake_up(self, e):
            raise e

    watchdog.set_step(4)
    with watchdog.phase("sync"):
        with pytest.raises(RolloutEngineError) as e:
            Engine().wake_up(RuntimeError("CUDA error: out of memory"))
    assert str(e.value) == (
        "step 4, phase sync: the rollout engine failed in its wake-up: RuntimeError: CUDA error: out of memory; "
        "it looks like memory: lower actor_rollout_ref.rollout.gpu_memory_utilization (now 0.6), or "
        "rollout.max_num_seqs / max_num_batched_tokens, or offload the trainer's state during generation "
        "(actor_rollout_ref.actor.megatron.param_offload, optimizer_offload) so the engine has more of the device")
    with watchdog.phase("gen"), pytest.raises(RolloutEngineError) as e:
        Engine().wake_up(ValueError("bad token id 7"))
    assert str(e.value) == "step 4, phase gen: the rollout engine failed in its wake-up: ValueError: bad token id 7"
