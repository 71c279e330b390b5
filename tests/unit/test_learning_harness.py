"""benchmarks/learning.py's bookkeeping: samples to target, the collapse flag, medians over seeds."""
import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("learning_bench", REPO / "benchmarks" / "learning.py")
learning = importlib.util.module_from_spec(spec)
spec.loader.exec_module(learning)


def _curve(scores, entropies):
    return [{"step": i + 1, "samples": 256 * (i + 1), "score": s, "seconds": float(i), "entropy": e}
            for i, (s, e) in enumerate(zip(scores, entropies))]


def test_samples_to_target_is_the_first_5_step_mean_at_target():
    scores = [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    r = learning.summarise(_curve(scores, [4.0] * 11), target=0.8, budget=10**9)
    # running means: step 6 -> 0.2, 7 -> 0.4, 8 -> 0.6, 9 -> 0.8, 10 -> 1.0
    assert r["samples_to_target"] == 256 * 9 and not r["collapsed"]
    r = learning.summarise(_curve(scores, [4.0] * 11), target=0.81, budget=10**9)
    assert r["samples_to_target"] == 256 * 10


def test_collapse_flag():
    flat = [0.02] * 20
    assert learning.summarise(_curve(flat, [4.0 - 0.15 * i for i in range(20)]), 0.5, 10**9)["collapsed"]
    assert not learning.summarise(_curve(flat, [4.0 - 0.05 * i for i in range(20)]), 0.5, 10**9)["collapsed"]
    rising = [0.02 + 0.05 * i for i in range(20)]   # entropy falls because the policy learns
    assert not learning.summarise(_curve(rising, [4.0 - 0.15 * i for i in range(20)]), 0.99, 10**9)["collapsed"]


def test_collapse_flag_of_a_warm_start_reads_the_best_samples():
    """copy_warm: 0.38 -> 0.63 as the entropy halves; with the best sample score in the curve it
    learns, without it (the doubling rule alone) it would be flagged."""
    scores = [0.42, 0.36, 0.34, 0.36, 0.43, 0.47, 0.55, 0.58, 0.60, 0.62, 0.66, 0.70]
    entropy = [2.57, 2.51, 2.55, 2.43, 2.31, 2.13, 1.85, 1.79, 1.64, 1.50, 1.36, 1.21]
    curve = _curve(scores, entropy)
    assert learning.summarise(curve, 0.99, 10**9)["collapsed"]
    assert not learning.summarise([dict(r, score_max=1.0) for r in curve], 0.99, 10**9)["collapsed"]


def test_median_counts_a_missed_target_as_infinite():
    assert learning.median_spread([1000, None, 3000]) == (3000, 1000, None)
    assert learning.median_spread([1000, None, None]) == (None, 1000, None)
    assert learning.median_spread([2000, 1000, 3000]) == (2000, 1000, 3000)


def test_every_megappo_method_has_its_samples_per_step():
    assert set(learning.MEGAPPO) == set(learning.SAMPLES_PER_STEP)
    for method, overrides in learning.MEGAPPO.items():
        last = dict(o.split("=", 1) for o in overrides)
        assert learning.SAMPLES_PER_STEP[method] == int(last["actor_rollout_ref.rollout.n"]) * int(last["data.train_batch_size"])


def test_gae1_runs_at_the_settings_trl_runs_the_task_with(tmp_path):
    """gae1 = TRL's settings: the lr trl_ppo.py is given for the task, for policy AND value model
    (TRL has one optimizer), and no gradient clipping (TRL's PPO loop clips none); gae1_clip keeps
    megappo's clip and critic lr. The last occurrence of a key wins on megappo's command line."""
    paths = {"model": "m", "train": "t", "test": "v"}
    for task, trl in learning.TRL_ARGS.items():
        lr = trl[trl.index("--lr") + 1]
        last = dict(a.split("=", 1) for a in learning.megappo_args("gae1", task, paths, tmp_path, 3, 0) if "=" in a)
        assert last["actor_rollout_ref.actor.optim.lr"] == last["critic.optim.lr"] == lr, task
        assert last["actor_rollout_ref.actor.optim.clip_grad"] == last["critic.optim.clip_grad"] == "0", task
        clip = dict(a.split("=", 1) for a in learning.megappo_args("gae1_clip", task, paths, tmp_path, 3, 0) if "=" in a)
        assert clip["actor_rollout_ref.actor.optim.lr"] == lr and clip["critic.optim.lr"] == "1e-3", task
        assert "actor_rollout_ref.actor.optim.clip_grad" not in clip, task
    assert learning.TRL_ARGS["echo"][learning.TRL_ARGS["echo"].index("--lr") + 1] == "1e-4"   # a task where it differs
    # gae1_trl: gae1 plus TRL's choice wherever verl's default differs (trl_ppo.py's defaults: value
    # clip 0.2, weight decay 0; TRL shuffles every epoch, has no dual clip, starts a random head)
    for task, trl in learning.TRL_ARGS.items():
        m = dict(a.split("=", 1) for a in learning.megappo_args("gae1_trl", task, paths, tmp_path, 3, 0) if "=" in a)
        lr = trl[trl.index("--lr") + 1]
        assert m["actor_rollout_ref.actor.optim.lr"] == m["critic.optim.lr"] == lr, task
        assert m["critic.cliprange_value"] == "0.2" and m["actor_rollout_ref.actor.shuffle"] == "true", task
        assert m["actor_rollout_ref.actor.optim.weight_decay"] == m["critic.optim.weight_decay"] == "0", task
        assert float(m["actor_rollout_ref.actor.clip_ratio_c"]) > 1e6 and float(m["critic.model.value_head_init_std"]) > 0


def test_the_harness_imports_this_checkout():
    """The harness uses the megappo of the checkout the script sits in (not whatever the venv's
    editable install points at); its runs get the same folder first on PYTHONPATH."""
    import sys
    assert sys.path.index(str(learning.ROOT / "src")) < len(sys.path)


def test_the_harness_runs_each_process_single_threaded_unless_told():
    """Its runs (megappo and TRL) get one torch thread each: a child started with the harness's
    environment reports 1 where one started without it reports a thread per core; a user's own
    OMP_NUM_THREADS is kept."""
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    probe = [sys.executable, "-c", "import torch; print(torch.get_num_threads())"]
    assert subprocess.run(probe, env=learning._single_threaded(dict(base)), capture_output=True,
                          text=True, check=True).stdout.strip() == "1"
    assert learning._single_threaded(dict(base, OMP_NUM_THREADS="3"))["OMP_NUM_THREADS"] == "3"
    cores = len(os.sched_getaffinity(0))
    if cores > 1:   # without the variable torch takes every core (so the harness's choice matters)
        assert subprocess.run(probe, env=base, capture_output=True, text=True,
                              check=True).stdout.strip() == str(cores)


def test_a_run_that_fails_before_its_first_step_is_reported_with_its_log(tmp_path):
    """Not a FileNotFoundError about the metrics it never wrote: the run, and its log's end."""
    missing = tmp_path / "no_model"
    paths = dict(model=str(missing), train=str(tmp_path / "no.parquet"), test=str(tmp_path / "no.parquet"))
    with pytest.raises(RuntimeError, match="words/grpo/seed 0 failed") as e:
        learning.run_megappo("grpo", "words", paths, tmp_path, 3, 0)
    assert str(missing) in str(e.value), str(e.value)[-1500:]


def test_lookup_without_tools_is_the_same_run_with_multi_turn_off(tmp_path):
    """The tool-use task's two runs differ in the tool only: same data, model, settings."""
    from megappo.config import load_config, validate
    from megappo.data.tiny import make_tiny_setup

    paths = make_tiny_setup(str(tmp_path / "setup"), task="lookup", n_train=16, n_test=4)
    cfgs = {}
    for task in ("lookup", "lookup_notools"):
        args = learning.megappo_args("gae", task, paths, tmp_path / "run", 10, 0)
        cfg = load_config(args[args.index("tiny_cpu") + 1:], ["tiny_cpu"])
        validate(cfg, check_paths=True, world_size=1)
        cfgs[task] = cfg
    on, off = cfgs["lookup"], cfgs["lookup_notools"]
    mt = on.actor_rollout_ref.rollout.multi_turn
    assert mt.enable and not off.actor_rollout_ref.rollout.multi_turn.enable
    assert mt.max_assistant_turns == 2 and Path(mt.tool_config_path) == REPO / "examples" / "tools" / "lookup.yaml"
    assert on.actor_rollout_ref.actor.optim.lr == off.actor_rollout_ref.actor.optim.lr == 3e-4
    on.actor_rollout_ref.rollout.multi_turn = off.actor_rollout_ref.rollout.multi_turn
    on.data.return_raw_chat = off.data.return_raw_chat
    assert on == off


def test_compare_medians_then_score_at_budget():
    """gae <= grpo: medians of samples to target (a miss is infinite); when both miss, the score at the budget."""
    r = lambda n, score=0.1: {"samples_to_target": n, "score_at_budget": score}
    assert learning.compare([r(100), r(300), r(None)], [r(200), r(250), r(260)])[0] is False   # 300 > 250
    assert learning.compare([r(100), r(240), r(None)], [r(200), r(250), r(260)])[0] is True
    assert learning.compare([r(100), r(None), r(None)], [r(100), r(100), r(None)])[0] is False  # a median miss loses
    assert learning.compare([r(500), r(500), r(None)], [r(None), r(None), r(100)])[0] is True   # theirs never: ok
    ok, line = learning.compare([r(None, 0.2), r(None, 0.1), r(5, 0.6)], [r(None, 0.15), r(None, 0.12), r(None, 0.1)])
    assert ok and "0.200 vs 0.120" in line
    assert learning.compare([r(None, 0.1)] * 3, [r(None, 0.11)] * 3)[0] is False


def test_score_at_budget_has_its_standard_error_and_compare_names_a_gap_within_it():
    """summarise: the standard error of the last 5 steps' mean (their sample standard deviation /
    sqrt(5), computed here with numpy); compare: the verdict is the rule's either way, and the line
    says "noise" only when the gap is under 2 standard errors of the difference of the median runs."""
    import numpy as np

    scores = [0.5] * 6 + [0.010, 0.022, 0.014, 0.019, 0.011]
    r = learning.summarise(_curve(scores, [4.0] * 11), target=0.9, budget=10**9)
    assert r["score_at_budget_se"] == round(float(np.std(scores[-5:], ddof=1) / np.sqrt(5)), 4) > 0
    assert learning.summarise(_curve([0.1], [4.0]), 0.9, 10**9)["score_at_budget_se"] is None

    run = lambda score, se: {"samples_to_target": None, "score_at_budget": score, "score_at_budget_se": se}
    mine = [run(0.013, 0.002), run(0.014, 0.003), run(0.016, 0.009)]   # median run: 0.014, se 0.003
    theirs = [run(0.012, 0.001), run(0.016, 0.004), run(0.016, 0.004)]  # median run: 0.016, se 0.004
    assert learning.gap_se(mine, theirs) == pytest.approx(0.005)
    ok, line = learning.compare(mine, theirs)
    assert ok is False and "0.014 vs 0.016" in line and "noise" in line and "0.010" in line
    far = [run(0.030, 0.003)] * 3
    ok, line = learning.compare(far, theirs)
    assert ok is True and "noise" not in line
    ok, line = learning.compare([run(0.004, 0.003)] * 3, theirs)   # 0.012 below: a measured gap
    assert ok is False and "noise" not in line
    # runs without a standard error (older curves) keep the old line
    assert "noise" not in learning.compare([run(0.014, None)] * 3, theirs)[1]


def test_paired_counts_seeds_and_gives_the_sign_test():
    """Seed by seed: fewer samples wins, a miss loses to a hit, two misses go by the score at the
    budget; p is the two-sided sign test over the seeds that differ (binomial(n, 1/2))."""
    r = lambda n, score=0.1: {"samples_to_target": n, "score_at_budget": score}
    mine = [r(100), r(None, 0.3), r(None, 0.2), r(400), r(500)]
    theirs = [r(200), r(900), r(None, 0.1), r(400), r(None, 0.9)]
    assert learning.paired(mine, theirs) == {"ahead": 3, "level": 1, "behind": 1, "sign_test_p": 0.625}  # 2*5/16
    assert learning.paired([r(1)] * 8, [r(2)] * 8)["sign_test_p"] == round(2 / 2 ** 8, 4)
    assert learning.paired([r(1)] * 3, [r(1)] * 3) == {"ahead": 0, "level": 3, "behind": 0, "sign_test_p": 1.0}
    # order matters: the lists are paired by seed, not sorted
    assert learning.paired([r(100), r(300)], [r(200), r(250)])["ahead"] == 1


def test_a_warm_task_starts_every_method_from_the_fine_tuned_model(tmp_path):
    """pick_first_warm: the same data as pick_first, the model fine-tuned on the answer (new
    weights, made once per setup folder), and megappo's runs start from it."""
    import torch
    from safetensors.torch import load_file

    from megappo.data.tiny import make_tiny_setup

    spec = learning.TASKS["pick_first_warm"]
    assert spec["setup"] == "pick_first" and spec["warm_sft_steps"] > 0
    paths = make_tiny_setup(str(tmp_path / "s"), task="pick_first", n_train=64, seed=0)
    warm = learning.warm_start(paths, 2)
    assert warm["train"] == paths["train"] and warm["model"] != paths["model"]
    before = load_file(str(Path(paths["model"]) / "model.safetensors"))
    after = load_file(str(Path(warm["model"]) / "model.safetensors"))
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    stamp = (Path(warm["model"]) / "model.safetensors").stat().st_mtime_ns
    assert learning.warm_start(paths, 2) == warm
    assert (Path(warm["model"]) / "model.safetensors").stat().st_mtime_ns == stamp   # made once
    args = learning.megappo_args("gae", "pick_first_warm", warm, tmp_path, 3, 0)
    assert f"actor_rollout_ref.model.path={warm['model']}" in args
