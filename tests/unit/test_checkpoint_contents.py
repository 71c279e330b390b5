"""checkpoint.save_contents / load_contents (verl's keys): what a config may ask for, the check that
keeps a run of HF exports from overwriting another's, and verl's own config file's defaults."""
import os
from pathlib import Path

import pytest

from megappo.checkpoint import CheckpointError
from megappo.config import load_config, resumable_checkpoints, validate

A = "actor_rollout_ref.actor."
HERE = Path(__file__).parent
GRPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"]


def _cfg(*overrides, root=None):
    extra = [f"trainer.default_local_dir={root}"] if root else []
    cfg = load_config([*overrides, *extra], ["tiny_cpu"])
    validate(cfg)
    return cfg


def test_accepted_contents():
    assert resumable_checkpoints(_cfg())
    assert resumable_checkpoints(_cfg(A + "checkpoint.save_contents=[model,optimizer,extra,hf_model]",
                                      "critic.checkpoint.save_contents=[extra,optimizer,model]"))
    # exports only: the actor alone (GRPO has no critic), or both roles
    assert not resumable_checkpoints(_cfg(A + "checkpoint.save_contents=[hf_model]", *GRPO))
    cfg = _cfg(A + "checkpoint.save_contents=[hf_model]", "critic.checkpoint.save_contents=[hf_model]")
    assert not resumable_checkpoints(cfg) and cfg.actor_rollout_ref.actor.checkpoint.load_contents == ["hf_model"]
    # load_contents follows save_contents (verl's ${.save_contents}); hf_model in it is ignored
    assert _cfg(A + "checkpoint.save_contents=[model,optimizer,extra,hf_model]").actor_rollout_ref.actor.checkpoint.load_contents \
        == ["model", "optimizer", "extra", "hf_model"]
    _cfg(A + "checkpoint.load_contents=[model,optimizer,extra]", A + "checkpoint.save_contents=[model,optimizer,extra,hf_model]")


def test_verl_config_file_and_its_relative_default():
    """verl's generated Megatron config carries both keys (load_contents: ${.save_contents});
    hf_model set on the command line reaches both."""
    warnings = []
    cfg = load_config([A + "checkpoint.save_contents=['model','optimizer','extra','hf_model']"],
                      [str(HERE / "verl_ppo_megatron_trainer.yaml")], warnings=warnings)
    assert cfg.actor_rollout_ref.actor.checkpoint.save_contents == ["model", "optimizer", "extra", "hf_model"]
    assert cfg.actor_rollout_ref.actor.checkpoint.load_contents == ["model", "optimizer", "extra", "hf_model"]
    assert cfg.critic.checkpoint.load_contents == ["model", "optimizer", "extra"]
    assert not any("checkpoint" in w for w in warnings), warnings


def test_async_save_is_refused_by_name():
    from megappo.config.schema import ConfigError

    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.checkpoint\.async_save: is not supported: "
                                          r"megappo saves synchronously"):
        load_config([A + "checkpoint.async_save=true"], ["tiny_cpu"])
    load_config([A + "checkpoint.async_save=false"], ["tiny_cpu"])   # verl's default


def _exports(root: Path, *steps: int) -> None:
    for s in steps:
        hf = root / f"global_step_{s}" / "actor" / "huggingface"
        hf.mkdir(parents=True)
        (hf / "config.json").write_text("{}")
        (hf / "model.safetensors").write_bytes(b"")


def test_an_export_run_does_not_overwrite_another_runs_exports(tmp_path):
    from megappo.trainer.run_state import check_run_dir

    root = tmp_path / "run"
    export = [A + "checkpoint.save_contents=[hf_model]", *GRPO]
    check_run_dir(_cfg(*export, root=root))            # no folder yet
    _exports(root, 10, 2)
    for run in (export, GRPO):   # a run of exports, or of checkpoints: either would start over and overwrite them
        with pytest.raises(CheckpointError, match=r"holds HuggingFace exports of an earlier run \(global_step_2 \.\. "
                                                  r"global_step_10\) and no checkpoint to resume"):
            check_run_dir(_cfg(*run, root=root))
    check_run_dir(_cfg(*export, "trainer.resume_mode=disable", root=root))   # asked to start over here
    # exports over a folder of checkpoints: refused where it would start over
    _resumable(root, 4)
    with pytest.raises(CheckpointError, match=r"holds resumable checkpoints \(global_step_4 \.\. global_step_4\) and "
                                              r"this run's saves are HuggingFace exports"):
        check_run_dir(_cfg(*export, "trainer.resume_mode=disable", root=root))
    check_run_dir(_cfg(*GRPO, "trainer.resume_mode=disable", root=root))


def test_load_checkpoint_names_an_export(tmp_path):
    from megappo.checkpoint import load_checkpoint

    _exports(tmp_path, 4)
    hf = os.path.join(tmp_path, "global_step_4", "actor", "huggingface")
    with pytest.raises(CheckpointError, match=f"nothing to resume; start a new run from them with "
                                              f"actor_rollout_ref.model.path={hf}"):
        load_checkpoint(str(tmp_path / "global_step_4"), {})
    (tmp_path / "global_step_5").mkdir()
    with pytest.raises(CheckpointError, match="no trainer_state.json"):
        load_checkpoint(str(tmp_path / "global_step_5"), {})


def test_a_resume_that_would_load_nothing_is_refused(tmp_path):
    """verl resumes the step and the data order but loads no weights when load_contents lacks
    them (an export-only run pointed at a checkpoint); megappo refuses before anything is built."""
    from megappo.trainer.run_state import check_run_dir

    (tmp_path / "global_step_3").mkdir()
    (tmp_path / "global_step_3" / "trainer_state.json").write_text("{}")
    (tmp_path / "latest").write_text("3")
    export = [A + "checkpoint.save_contents=[hf_model]", *GRPO]
    for mode in ("auto", "resume_path"):
        cfg = _cfg(*export, f"trainer.resume_mode={mode}", f"trainer.resume_from_path={tmp_path}/global_step_3",
                   root=tmp_path)
        with pytest.raises(CheckpointError, match=rf"global_step_3: trainer.resume_mode={mode} resumes from it, but "
                                                  r"actor_rollout_ref.actor.checkpoint.load_contents=\['hf_model'\] "
                                                  r"would load neither its weights nor its optimizer"):
            check_run_dir(cfg)
    check_run_dir(_cfg(*GRPO, root=tmp_path))   # the default contents resume it


def _resumable(root: Path, step: int) -> None:
    (root / f"global_step_{step}").mkdir(parents=True)
    (root / f"global_step_{step}" / "trainer_state.json").write_text("{}")


def test_pruning_counts_each_kind_apart_and_keeps_latest(tmp_path):
    """max_to_keep: exports never push out the checkpoint 'latest' names, and resumable saves
    do not push out exports."""
    from megappo.checkpoint import _prune, latest_step

    _resumable(tmp_path, 10)
    (tmp_path / "latest").write_text("10")
    _exports(tmp_path, 20, 30)
    _prune(str(tmp_path), 1, resumable=False)
    assert sorted(os.listdir(tmp_path)) == ["global_step_10", "global_step_30", "latest"]
    assert latest_step(str(tmp_path)) == 10
    _resumable(tmp_path, 40)
    _prune(str(tmp_path), 1, resumable=True)   # 'latest' (10) stays even though 40 is newer
    assert sorted(os.listdir(tmp_path)) == ["global_step_10", "global_step_30", "global_step_40", "latest"]


def test_an_export_never_replaces_a_resumable_checkpoint(tmp_path):
    from megappo.checkpoint import _publish

    _resumable(tmp_path, 5)
    (tmp_path / "latest").write_text("5")
    (tmp_path / ".tmp_global_step_5").mkdir()
    with pytest.raises(CheckpointError, match="global_step_5 holds a resumable checkpoint: an HF export of the same "
                                              "step does not replace it"):
        _publish(str(tmp_path), str(tmp_path / ".tmp_global_step_5"), str(tmp_path / "global_step_5"), 5,
                 point_latest=False)
    assert (tmp_path / "global_step_5" / "trainer_state.json").is_file()


def test_an_invalid_list_is_named_once():
    from megappo.config.schema import ConfigError

    with pytest.raises(ConfigError) as e:
        _cfg(A + "checkpoint.save_contents=[model,hf_model]")   # (tiny_cpu has a critic with the default list)
    assert [k for k, _ in e.value.errors] == [A + "checkpoint.save_contents"]
