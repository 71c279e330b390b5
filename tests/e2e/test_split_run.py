"""The split placement end to end on the tiny echo task: 2 training ranks and 2 rollout
ranks in one job. Synchronous, it trains exactly as the colocated run on 2 ranks (every metric but
timings); one-step off-policy (tiny words task), step 1 trains on a batch of the initial weights and every later step
on a batch of the weights one update behind (training/weight_version_lag, and the engine's
log-probs drift from the actor's exactly when the lag is 1). In both modes a run resumed from a
checkpoint (which stores the batch in flight) repeats the uninterrupted run's next step. A LoRA
actor's adapters travel over the bridge and the rollout ranks serve them: the run is the colocated
LoRA run's, metric for metric; where the engines cannot serve adapters the merged weights go."""
import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))

VOLATILE = ("timing_s/", "perf/")
SPLIT = ["actor_rollout_ref.hybrid_engine=false", "rollout.n_gpus_per_node=2"]


def _run(rank, world, setup, run_dir, steps, extra, port=None):
    launch(world, [f"actor_rollout_ref.model.path={setup['model']}", f"data.train_files=[{setup['train']}]",
                   f"data.val_files=[{setup['test']}]", "trainer.logger=[file]", "trainer.n_gpus_per_node=2",
                   f"trainer.default_local_dir={run_dir}", f"trainer.total_training_steps={steps}",
                   "trainer.val_before_train=false", f"trainer.test_freq={steps}", "trainer.save_freq=2",
                   "data.max_response_length=6", "actor_rollout_ref.actor.optim.lr=1e-3",
                   "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1",
                   "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
                   "actor_rollout_ref.rollout.tensor_model_parallel_size=1"] + list(extra), port)


def launch(world, overrides, port=None):
    """One rank of a run on the tiny_cpu preset with ``overrides``: with ``port`` (the split
    placement) the spawned world is remade from the launcher's environment, and the rollout ranks
    serve while the training ranks train."""
    import os

    import torch.distributed as dist

    from megappo.config import load_config, validate
    from megappo.trainer import PPOTrainer, init_distributed

    if port is not None:   # the split placement makes its own groups from the launcher's environment
        dist.destroy_process_group()
        os.environ["MASTER_PORT"] = str(port)
    cfg = load_config(list(overrides), ["tiny_cpu"])
    validate(cfg, check_paths=True, world_size=world)
    init_distributed(cfg)
    from megappo.distributed import split

    groups = split.current()
    if groups is not None and groups.role == "rollout":
        from megappo.trainer import serve

        serve(cfg, groups)
    else:
        PPOTrainer(cfg).fit()


def _rows(run_dir):
    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _stable(row):
    return {k: v for k, v in row.items() if not k.startswith(VOLATILE) and k != "training/weight_version_lag"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from megappo.data.tiny import make_tiny_setup

    root = tmp_path_factory.mktemp("split")
    return root, make_tiny_setup(str(root / "tiny"), n_train=64, n_test=8)


@pytest.mark.e2e
def test_split_synchronous_trains_as_colocated(tiny):
    from harness import free_port, spawn

    root, setup = tiny
    logged = ["trainer.log_val_generations=3"]
    spawn(_run, 2, setup, str(root / "colocated"), 3, logged)
    spawn(_run, 4, setup, str(root / "split_sync"), 3, SPLIT + logged, free_port())
    colocated, split = _rows(root / "colocated"), _rows(root / "split_sync")
    assert [r["step"] for r in split] == [1, 2, 3] and "val-core/synthetic/echo/reward/mean@1" in split[-1]
    assert all(r["training/weight_version_lag"] == 0 for r in split)
    for a, b in zip(colocated, split):
        assert _stable(a) == _stable(b), sorted(k for k in _stable(a) if _stable(b).get(k) != _stable(a)[k])
    # the validation samples logged (trainer.log_val_generations): the same from the rollout ranks
    generations = (root / "split_sync" / "val_generations.jsonl").read_text()
    assert generations == (root / "colocated" / "val_generations.jsonl").read_text()
    _rescored(setup, [json.loads(x) for x in generations.splitlines()])
    # resumed from its step-2 checkpoint (nothing in flight when synchronous), step 3 repeats itself
    _resume_from_step_2(root / "split_sync", root / "split_sync_resumed", setup, SPLIT, split)


@pytest.mark.e2e
def test_split_at_cp2_trains_as_colocated(tiny):
    """The training ranks at context parallelism 2 (one DP rank): the bridge sends what the
    colocated run's engines load, and every metric is the colocated CP2 run's."""
    from harness import free_port, spawn

    root, setup = tiny
    cp = ["actor_rollout_ref.actor.megatron.context_parallel_size=2"]
    spawn(_run, 2, setup, str(root / "colocated_cp2"), 2, cp)
    spawn(_run, 4, setup, str(root / "split_cp2"), 2, SPLIT + cp, free_port())
    colocated, split = _rows(root / "colocated_cp2"), _rows(root / "split_cp2")
    assert [r["step"] for r in split] == [1, 2]
    for a, b in zip(colocated, split):
        assert _stable(a) == _stable(b), sorted(k for k in _stable(a) if _stable(b).get(k) != _stable(a)[k])
    assert split[-1]["training/rollout_probs_diff_max"] < 1e-4   # the rollout ranks hold the actor's weights


def _rescored(setup, records):
    """Each logged validation sample is one of the validation prompts, decoded, and its score is
    what the task's reward function gives the logged output."""
    from transformers import AutoTokenizer

    from megappo.data import PromptDataset
    from megappo.rewards import score_batch

    tok = AutoTokenizer.from_pretrained(setup["model"])
    items = {tok.decode(it.prompt_ids, skip_special_tokens=True): it
             for it in PromptDataset(setup["test"], tok, max_prompt_length=64).items}
    assert len(records) == 3 and all(r["step"] == 3 for r in records)
    assert len({r["input"] for r in records}) == 3 and all(r["input"] in items for r in records)
    it = [items[r["input"]] for r in records]
    want = score_batch([i.data_source for i in it], [r["output"] for r in records], [i.ground_truth for i in it],
                       [i.extra_info for i in it])
    assert [r["score"] for r in records] == pytest.approx(want), (records, want)


def _resume_from_step_2(run, resumed, setup, extra, rows):
    from harness import free_port, spawn

    resumed.mkdir()
    shutil.copytree(run / "global_step_2", resumed / "global_step_2")
    (resumed / "latest").write_text("2")
    (resumed / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    spawn(_run, 4, setup, str(resumed), 3, extra + ["trainer.resume_mode=auto"], free_port())
    again = _rows(resumed)
    assert [r["step"] for r in again] == [1, 2, 3]
    assert _stable(again[2]) == _stable(rows[2]), sorted(
        k for k in _stable(rows[2]) if _stable(again[2]).get(k) != _stable(rows[2])[k])
    return again


@pytest.mark.e2e
def test_one_step_off_lags_one_version_and_resumes_exactly(tiny):
    from harness import free_port, spawn

    from megappo.data.tiny import make_tiny_setup

    root, _ = tiny
    # the words task rewards part of every response from the start: the actor moves at step 1
    setup = make_tiny_setup(str(root / "words"), n_train=64, n_test=8, task="words")
    run = root / "one_step_off"
    spawn(_run, 4, setup, str(run), 3, SPLIT + ["trainer.async_mode=one_step_off"], free_port())
    rows = _rows(run)
    assert [r["training/weight_version_lag"] for r in rows] == [0.0, 1.0, 1.0]
    # the engine's log-probs are the actor's when it holds the same weights, not when one update behind
    drift = [r["training/rollout_probs_diff_max"] for r in rows]
    assert drift[0] < 1e-4 and min(drift[1:]) > 1e-3, drift

    again = _resume_from_step_2(run, root / "one_step_off_resumed", setup, SPLIT + ["trainer.async_mode=one_step_off"],
                                rows)
    assert again[2]["training/weight_version_lag"] == 1.0


def _run_with_slow_update(rank, world, setup, run_dir, steps, extra, port):
    """_run with every training rank's first actor update 15 s longer."""
    import time

    from megappo.workers import Actor

    update = Actor.update_policy

    def slow(self, *a, **k):
        if not getattr(Actor, "_slept", False):
            Actor._slept = True
            end = time.time() + 15
            while time.time() < end:   # working, not sleeping: a long step uses CPU (the watchdog
                sum(range(1000))       # ends a job whose every rank is blocked)
        return update(self, *a, **k)

    Actor.update_policy = slow
    _run(rank, world, setup, run_dir, steps, extra, port)


@pytest.mark.e2e
def test_a_training_step_longer_than_the_timeout_does_not_break_the_bridge(tiny):
    """The rollout ranks wait for the next command through the whole update, and (one-step off)
    the first one's generation waits for rank 0 to collect it after the update: 15 s against a
    10 s process-group timeout. Both meet in the job's store first, so the run finishes. The
    watchdog, at a 5 s silence, sees every rank of both roles beat through the wait."""
    from harness import free_port, spawn

    root, setup = tiny
    run = root / "slow_update"
    spawn(_run_with_slow_update, 4, setup, str(run), 2,
          SPLIT + ["trainer.async_mode=one_step_off", "trainer.dist_timeout_s=10", "trainer.save_freq=-1",
                   "trainer.watchdog_silence_s=5"], free_port())
    rows = _rows(run)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["timing_s/update_actor"] >= 15


LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.actor.optim.lr=1e-2"]


def _run_checked(rank, world, setup, run_dir, steps, extra, port=None, merged=False):
    """_run under the CPU device check (a simulated GPU per rank; the bridge's tensors too);
    ``merged``: engines that cannot serve adapters (vLLM's ranks stop at 512) take merged weights."""
    import os

    os.environ["MEGAPPO_CHECK_DEVICES"] = "1"
    if merged:
        from megappo import builders

        builders.engine_lora_rank = lambda cfg: 0
    _run(rank, world, setup, run_dir, steps, extra, port)


def _model_bytes(model_dir):
    """Bytes of the HF model's weights in float32 (the CPU engine's dtype)."""
    from safetensors.torch import load_file

    return sum(t.numel() * 4 for t in load_file(str(Path(model_dir) / "model.safetensors")).values())


@pytest.mark.e2e
def test_split_with_lora_serves_the_adapters_as_colocated(tiny):
    """Under the CPU device check, the bridge sends the base once and then only the adapters; the
    rollout ranks' engines serve them: every metric equals the colocated LoRA run's, the engines' log-probs are the actor's,
    and a run resumed from step 2 (base and adapters sent again) repeats step 3. With engines that
    cannot serve adapters, each sync sends the merged weights, which the engines' log-probs match."""
    from harness import free_port, spawn

    from megappo.data.tiny import make_tiny_setup

    root, _ = tiny
    # words: a random policy scores partly, so the adapters move from the first step
    setup = make_tiny_setup(str(root / "words_lora"), n_train=64, n_test=8, task="words")
    spawn(_run_checked, 2, setup, str(root / "colocated_lora"), 3, LORA)
    spawn(_run_checked, 4, setup, str(root / "split_lora"), 3, SPLIT + LORA, free_port())
    colocated, split = _rows(root / "colocated_lora"), _rows(root / "split_lora")
    assert [r["step"] for r in split] == [1, 2, 3]
    for a, b in zip(colocated, split):
        assert _stable(a) == _stable(b), sorted(k for k in _stable(a) if _stable(b).get(k) != _stable(a)[k])
    full = _model_bytes(setup["model"])
    for r in split:
        assert r["training/rollout_probs_diff_max"] < 1e-4, r   # the engines serve the actor's adapters
        assert 0 < r["rollout/sync_bytes"] < 0.2 * full, (r["rollout/sync_bytes"], full)   # adapters only
    assert split[-1]["actor/grad_norm"] > 0
    _resume_from_step_2(root / "split_lora", root / "split_lora_resumed", setup, SPLIT + LORA, split)

    spawn(_run_checked, 4, setup, str(root / "split_lora_merged"), 2, SPLIT + LORA, free_port(), True)
    for r in _rows(root / "split_lora_merged"):
        assert r["training/rollout_probs_diff_max"] < 1e-4, r
        assert r["rollout/sync_bytes"] == full, (r["rollout/sync_bytes"], full)   # the merged model, every step
