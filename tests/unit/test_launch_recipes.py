"""GPU recipes over launch/common.sh: DRY_RUN=1 prints the resolved config and the rank layout;
a layout that does not divide the world fails naming the variables, before anything starts."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def _dry(script, **env):
    e = dict(os.environ, DRY_RUN="1", PYTHON=sys.executable, **env)
    return subprocess.run(["bash", str(REPO / "launch" / script), "trainer.total_training_steps=7"],
                          capture_output=True, text=True, env=e, timeout=120)


def _config(stdout):
    text = stdout.split("# resolved configuration\n", 1)[1].split("# layout:", 1)[0]
    return yaml.safe_load(text)


def test_gsm8k_recipe_resolves_verls_reference_settings():
    p = _dry("qwen2_5_0_5b_gsm8k.sh", TRAIN_FILES="/data/a.parquet,/data/b.parquet")
    assert p.returncode == 0, p.stderr
    cfg = _config(p.stdout)
    assert cfg["actor_rollout_ref"]["model"]["path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg["critic"]["model"]["path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert cfg["data"]["train_files"] == ["/data/a.parquet", "/data/b.parquet"]
    assert cfg["data"]["train_batch_size"] == 256 and cfg["data"]["max_prompt_length"] == 512
    assert cfg["actor_rollout_ref"]["actor"]["optim"]["lr"] == 1e-6 and cfg["critic"]["optim"]["lr"] == 1e-5
    assert cfg["actor_rollout_ref"]["actor"]["use_dynamic_bsz"] is True
    assert cfg["actor_rollout_ref"]["rollout"]["max_num_batched_tokens"] == 16384
    assert cfg["algorithm"]["adv_estimator"] == "gae" and cfg["trainer"]["total_training_steps"] == 7
    assert "# layout: world=8 (1 node(s) x 8) | train: TP=1 PP=1 DP=8 | rollout: TP=1 DP=8" in p.stdout


def test_layout_not_dividing_the_world_names_the_variables():
    p = _dry("qwen2_5_0_5b_gsm8k.sh", ACTOR_TP="4", NGPUS_PER_NODE="6")
    assert p.returncode == 2 and "resolved configuration" not in p.stdout
    assert "ACTOR_TP=4 x ACTOR_PP=1 = 4 does not divide the world NNODES=1 x NGPUS_PER_NODE=6 = 6" in p.stderr
    p = _dry("qwen2_5_0_5b_gsm8k.sh", ROLLOUT_TP="3")
    assert p.returncode == 2 and "ROLLOUT_TP=3 does not divide" in p.stderr


def test_context_parallelism_from_the_environment():
    p = _dry("qwen3_8b.sh", ACTOR_TP="2", ACTOR_PP="2", ACTOR_CP="2", NNODES="2", NGPUS_PER_NODE="8")
    assert p.returncode == 0, p.stderr
    cfg = _config(p.stdout)
    assert cfg["actor_rollout_ref"]["actor"]["megatron"]["context_parallel_size"] == 2
    assert cfg["critic"]["megatron"]["context_parallel_size"] == 2    # the critic's layout is the actor's
    assert "train: TP=2 PP=2 CP=2 DP=2 | rollout: TP=2 DP=8" in p.stdout
    assert "TP2 PP2 CP2 DP2" in p.stdout    # the memory plan's layout
    p = _dry("qwen3_8b.sh", ACTOR_TP="2", ACTOR_CP="3", NGPUS_PER_NODE="8")
    assert p.returncode == 2 and "ACTOR_TP=2 x ACTOR_CP=3 x ACTOR_PP=2 = 12 does not divide the world" in p.stderr


def test_qwen3_8b_dry_run_shows_the_layout_for_the_given_nodes():
    p = _dry("qwen3_8b.sh", ACTOR_TP="2", ACTOR_PP="2", NNODES="2", NGPUS_PER_NODE="8")
    assert p.returncode == 0, p.stderr
    cfg = _config(p.stdout)
    meg = cfg["actor_rollout_ref"]["actor"]["megatron"]
    assert (meg["tensor_model_parallel_size"], meg["pipeline_model_parallel_size"]) == (2, 2)
    assert cfg["critic"]["megatron"]["tensor_model_parallel_size"] == 2
    assert cfg["data"]["train_files"] == [os.path.expanduser("~/data/gsm8k/train.parquet"),
                                          os.path.expanduser("~/data/math/train.parquet")]
    assert cfg["actor_rollout_ref"]["actor"]["ppo_max_token_len_per_gpu"] == 24576
    assert cfg["critic"]["ppo_max_token_len_per_gpu"] == 24576
    assert cfg["actor_rollout_ref"]["rollout"]["tensor_model_parallel_size"] == 2
    assert cfg["trainer"]["balance_batch"] is True and cfg["trainer"]["save_freq"] == 20
    assert "# layout: world=16 (2 node(s) x 8) | train: TP=2 PP=2 DP=4 | rollout: TP=2 DP=8" in p.stdout
    p = _dry("qwen3_32b.sh")
    assert "train: TP=8 PP=2 VPP=2 DP=2" in p.stdout, p.stderr


PLANNED = ["data.train_batch_size", "data.max_prompt_length", "data.max_response_length",
           "actor_rollout_ref.model.path", "actor_rollout_ref.actor.ppo_mini_batch_size",
           "actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
           "actor_rollout_ref.rollout.n", "actor_rollout_ref.rollout.tensor_model_parallel_size",
           "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
           "actor_rollout_ref.rollout.max_num_batched_tokens", "critic.ppo_max_token_len_per_gpu",
           "actor_rollout_ref.actor.megatron", "critic.megatron", "actor_rollout_ref.ref.megatron", "trainer.nnodes",
           "trainer.n_gpus_per_node", "data.gen_batch_size", "algorithm.adv_estimator", "algorithm.filter_groups",
           "reward_model.overlong_buffer", "actor_rollout_ref.actor.clip_ratio_low",
           "actor_rollout_ref.actor.clip_ratio_high", "actor_rollout_ref.actor.clip_ratio_c"]


@pytest.mark.parametrize("recipe", ["qwen3_8b", "qwen3_14b", "qwen3_32b", "qwen3_32b_lora", "dapo_qwen3_8b", "qwen3_30b_a3b"])
def test_dry_run_plans_the_job_the_recipe_yaml_describes(recipe):
    """DRY_RUN=1 prints the memory plan; what the launch script resolves equals what its
    parallel_configs YAML alone gives (so `python -m megappo.plan --config <yaml>` plans the job)."""
    from megappo.config import get, load_config, to_dict

    p = _dry(f"{recipe}.sh", GPU_MEMORY_GB="80")
    assert p.returncode == 0, p.stderr
    assert "memory plan:" in p.stdout and "80 GiB per GPU" in p.stdout and ": FITS" in p.stdout, p.stdout
    launched, alone = _config(p.stdout), load_config([], [str(REPO / "parallel_configs" / f"{recipe}.yaml")])
    for key in PLANNED:
        node = launched
        for part in key.split("."):
            node = node[part]
        want = get(alone, key)
        want = to_dict(want) if hasattr(want, "__dataclass_fields__") else want
        assert node == want, (key, node, want)


def test_dapo_recipe_resolves_dapos_published_settings():
    p = _dry("dapo_qwen3_8b.sh")
    assert p.returncode == 0, p.stderr
    cfg = _config(p.stdout)
    act, al, ro = cfg["actor_rollout_ref"]["actor"], cfg["algorithm"], cfg["actor_rollout_ref"]["rollout"]
    assert (cfg["data"]["train_batch_size"], cfg["data"]["gen_batch_size"], act["ppo_mini_batch_size"], ro["n"]) == (
        512, 1536, 32, 16)
    assert (cfg["data"]["max_prompt_length"], cfg["data"]["max_response_length"]) == (2048, 20480)
    assert al["adv_estimator"] == "grpo" and al["use_kl_in_reward"] is False and act["use_kl_loss"] is False
    assert al["filter_groups"] == {"enable": True, "metric": "score", "max_num_gen_batches": 10}
    assert (act["clip_ratio_low"], act["clip_ratio_high"], act["clip_ratio_c"]) == (0.2, 0.28, 10.0)
    assert act["loss_agg_mode"] == "token-mean" and act["entropy_coeff"] == 0
    assert (act["optim"]["lr"], act["optim"]["lr_warmup_steps"], act["optim"]["weight_decay"]) == (1e-6, 10, 0.1)
    assert cfg["reward_model"]["overlong_buffer"] == {"enable": True, "len": 4096, "penalty_factor": 1.0, "max_resp_len": None}
    assert ro["val_kwargs"]["top_p"] == 0.7 and ro["val_kwargs"]["do_sample"] is True
    assert "train: TP=2 PP=2 DP=2 | rollout: TP=2 DP=4" in p.stdout and ": FITS" in p.stdout


def test_moe_recipe_lays_experts_over_eight_gpus():
    p = _dry("qwen3_30b_a3b.sh", GPU_MEMORY_GB="80")
    assert p.returncode == 0, p.stderr
    cfg = _config(p.stdout)
    assert cfg["actor_rollout_ref"]["actor"]["megatron"]["expert_model_parallel_size"] == 8
    assert cfg["actor_rollout_ref"]["ref"]["megatron"]["expert_model_parallel_size"] == 8   # inherited
    assert "train: TP=1 PP=1 DP=16 EP=8 | rollout: TP=4 DP=4" in p.stdout and "DP16 EP8" in p.stdout
    assert ": FITS" in p.stdout
    # one node of 80 GB GPUs does not fit: the plan says so (and the launcher checks EP against the stage)
    p = _dry("qwen3_30b_a3b.sh", GPU_MEMORY_GB="80", NNODES="1")
    assert p.returncode == 0 and "DOES NOT FIT" in p.stdout, p.stdout[-2000:]
    p = _dry("qwen3_30b_a3b.sh", ACTOR_EP="3")
    assert p.returncode == 2 and "ACTOR_EP=3 must divide the ranks of a pipeline stage" in p.stderr


def test_split_placement_dry_run_lays_out_both_groups():
    """ROLLOUT_GPUS takes GPUs of every node for vLLM (the rest train); ROLLOUT_NNODES gives the
    rollout nodes of its own. The dry run prints both groups' layouts; bad splits are named."""
    p = _dry("qwen3_8b.sh", ROLLOUT_GPUS="4", ASYNC_MODE="one_step_off", GPU_MEMORY_GB="80")
    assert p.returncode == 0, p.stderr
    cfg = _config(p.stdout)
    assert cfg["actor_rollout_ref"]["hybrid_engine"] is False and cfg["trainer"]["async_mode"] == "one_step_off"
    assert (cfg["trainer"]["n_gpus_per_node"], cfg["rollout"]["n_gpus_per_node"], cfg["rollout"]["nnodes"]) == (4, 4, 1)
    assert ("world=8 (split: 4 training ranks on 1 node(s) x 4 + 4 rollout ranks, the last 4 per node) | "
            "train: TP=2 PP=2 DP=1 | rollout: TP=2 DP=2 | one_step_off") in p.stdout
    assert "reserved), vLLM 0\n" in p.stdout and ": FITS" in p.stdout          # the training GPUs hold no vLLM
    p = _dry("qwen3_8b.sh", ROLLOUT_NNODES="1", NNODES="2")
    assert p.returncode == 0, p.stderr
    assert "world=24 (split: 16 training ranks on 2 node(s) x 8 + 8 rollout ranks, own nodes, 8 per node)" in p.stdout
    p = _dry("qwen3_8b.sh", ROLLOUT_GPUS="2")
    assert p.returncode == 2 and "does not divide the training ranks 1 node(s) x 6 = 6 (NGPUS_PER_NODE=8, ROLLOUT_GPUS=2)" in p.stderr
    p = _dry("qwen3_8b.sh", ROLLOUT_GPUS="4", ROLLOUT_TP="8")
    assert p.returncode == 2 and "ROLLOUT_TP=8 does not divide the rollout GPUs per node (4)" in p.stderr


def test_lora_recipe_takes_the_split_placement():
    """The LoRA recipe with vLLM on a node of its own: the adapters go over the bridge."""
    p = _dry("qwen3_32b_lora.sh", ROLLOUT_NNODES="1", NNODES="2", GPU_MEMORY_GB="80")
    assert p.returncode == 0, p.stderr
    cfg = _config(p.stdout)
    assert cfg["actor_rollout_ref"]["hybrid_engine"] is False and cfg["actor_rollout_ref"]["model"]["lora_rank"] == 64
    assert ("world=24 (split: 16 training ranks on 2 node(s) x 8 + 8 rollout ranks, own nodes, 8 per node) | "
            "train: TP=8 PP=1 DP=2 | rollout: TP=4 DP=2") in p.stdout
    assert ": FITS" in p.stdout


def test_ray_launcher_rank_plan_keeps_nodes_contiguous():
    from megappo.launch.ray import rank_plan

    plan = rank_plan(["b", "a", "b", "a"], {"a": "10.0.0.1", "b": "10.0.0.2"})
    assert [(p["bundle"], p["ip"], p["local_rank"], p["node_rank"]) for p in plan] == [
        (0, "10.0.0.2", 0, 0), (2, "10.0.0.2", 1, 0), (1, "10.0.0.1", 0, 1), (3, "10.0.0.1", 1, 1)]


def _exported_by_common_sh(**env) -> dict:
    """Variables that sourcing launch/common.sh adds to or changes in a GPU rank's environment
    (torchrun and SLURM ranks inherit them)."""
    base = {"PATH": os.environ["PATH"], "ACTOR_TP": "1", "ACTOR_PP": "1", "MODEL_PATH": "m", **env}
    out = subprocess.run(["bash", "-c", f'env -0; printf "\\1"; source "{REPO}/launch/common.sh" && env -0'],
                         env=base, capture_output=True, text=True, check=True, timeout=60).stdout
    before, after = ({k: v for k, _, v in (kv.partition("=") for kv in part.split("\0") if kv)}
                     for part in out.split("\1"))
    return {k: v for k, v in after.items() if before.get(k) != v}


def test_ray_launcher_gives_gpu_ranks_what_the_shell_launchers_export():
    from megappo.launch.ray import rank_env, rank_plan

    plan = rank_plan(["n0", "n0", "n1", "n1"], {"n0": "10.0.0.1", "n1": "10.0.0.2"})
    for user in ({}, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}):  # what a user exported, on the rank's node
        shell = _exported_by_common_sh(**user)
        assert "CUDA_DEVICE_MAX_CONNECTIONS" in shell
        for rank, entry in enumerate(plan):
            rank_process = dict(user, **rank_env(rank, entry, 4, "10.0.0.1", 29500, "cuda"))  # as RankActor.run
            assert {k: rank_process.get(k) for k in shell} == shell
    # torchrun's variables, consistent with the plan
    env = rank_env(3, plan[3], 4, "10.0.0.1", 29500, "cpu")
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == (
        "3", str(plan[3]["local_rank"]), "4", str(plan[3]["local_world"]), str(plan[3]["node_rank"]))
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29500")


def test_ray_launcher_rejects_a_bad_config_before_starting_ray(capsys):
    import pytest

    from megappo.launch import ray as launcher

    with pytest.raises(SystemExit) as e:
        launcher.main(["--nnodes", "1", "--nproc-per-node", "2", "--", "data.train_batch_size=-3"])
    assert e.value.code == 2
    assert "data.train_batch_size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        launcher.main(["--nnodes", "2", "--nproc-per-node", "2", "--", "--config", "tiny_cpu"])  # 1 node x 2
    assert e.value.code == 2
    assert "trainer.nnodes x trainer.n_gpus_per_node = 2" in capsys.readouterr().err
    split = ["--config", "tiny_cpu", "actor_rollout_ref.hybrid_engine=false", "rollout.n_gpus_per_node=2"]
    with pytest.raises(SystemExit) as e:   # the split placement's rollout ranks count too: 2 + 2
        launcher.main(["--nnodes", "1", "--nproc-per-node", "2", "--", *split])
    assert e.value.code == 2
    assert "trainer.nnodes x trainer.n_gpus_per_node + rollout.nnodes x rollout.n_gpus_per_node = 4" in capsys.readouterr().err


def test_ray_launcher_names_a_killed_rank_before_its_peers_errors():
    """Under load the killed rank's actor sees it die after its peer has already reported the
    broken connection: the signal death is still the cause (CI saw the peer named instead)."""
    from megappo.launch.ray import sort_failures

    peer = {"rank": 0, "code": 1, "time": 100.0, "error": "Connection reset by peer"}
    killed = {"rank": 1, "code": -9, "time": 100.4, "error": ""}
    assert [o["rank"] for o in sort_failures([peer, killed])] == [1, 0]
    first = {"rank": 2, "code": 1, "time": 99.0, "error": "ValueError"}
    assert [o["rank"] for o in sort_failures([peer, first])] == [2, 0]   # else the earliest


def _srun_args(tmp_path, **env):
    """The arguments launch/slurm.sbatch hands srun for the qwen3_8b recipe (srun and scontrol
    replaced by stand-ins that print their arguments / the first host)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 10.0.0.1\n")
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@"\n')
    for f in ("scontrol", "srun"):
        (bin_dir / f).chmod(0o755)
    full = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2",
            "SLURM_JOB_NODELIST": "n[1-2]", "NGPUS_PER_NODE": "8", **env}
    p = subprocess.run(["bash", str(REPO / "launch" / "slurm.sbatch"), str(REPO / "launch" / "qwen3_8b.sh")],
                       env=full, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.splitlines()


def test_slurm_runs_in_a_container_image(tmp_path):
    """CONTAINER_IMAGE: pyxis/enroot (srun --container-image) for an image name, Apptainer for a
    .sif file; either way the image's python runs one torchrun per node."""
    plain = _srun_args(tmp_path)
    assert plain[0] == "--nodes" and "--container-image" not in plain
    args = _srun_args(tmp_path, CONTAINER_IMAGE="nvcr.io#me/megappo:gpu")
    assert args[:2] == ["--container-image", "nvcr.io#me/megappo:gpu"] and "--container-mounts" in args
    cmd = args[args.index("-c") + 1]
    assert cmd.startswith("python -m torch.distributed.run --nnodes 2 --nproc_per_node 8 "), cmd
    args = _srun_args(tmp_path, CONTAINER_IMAGE="/img/megappo.sif")
    assert args[0] == "--nodes" and "--container-image" not in args
    cmd = args[args.index("-c") + 1]
    assert cmd.startswith("apptainer exec --nv --bind ") and " /img/megappo.sif bash -c python\\ -m\\ torch.distributed.run" in cmd


def test_gsm8k_tool_recipe_runs_multi_turn_with_the_shipped_calculator():
    p = _dry("qwen3_8b_gsm8k_tool.sh", GPU_MEMORY_GB="80")
    assert p.returncode == 0, p.stderr
    cfg = _config(p.stdout)
    ro, act = cfg["actor_rollout_ref"]["rollout"], cfg["actor_rollout_ref"]["actor"]
    mt = ro["multi_turn"]
    assert mt["enable"] is True and mt["max_assistant_turns"] == 5 and mt["format"] == "hermes"
    assert mt["tool_config_path"] == str(REPO / "examples" / "tools" / "calculator.yaml")
    assert cfg["data"]["train_files"] == [os.path.expanduser("~/data/gsm8k_tool/train.parquet")]
    assert cfg["algorithm"]["adv_estimator"] == "grpo" and ro["n"] == 8 and cfg["data"]["train_batch_size"] == 256
    assert act["use_kl_loss"] is True and act["kl_loss_type"] == "low_var_kl" and act["kl_loss_coef"] == 0.001
    assert cfg["actor_rollout_ref"]["model"]["path"] == "Qwen/Qwen3-8B"
    assert "train: TP=2 PP=2 DP=2 | rollout: TP=2 DP=4" in p.stdout and ": FITS" in p.stdout
    # a tool config that is not there is named before anything starts
    p = _dry("qwen3_8b_gsm8k_tool.sh", TOOL_CONFIG="/nonexistent/tools.yaml")
    assert p.returncode == 2 and "multi_turn.tool_config_path" in p.stderr and "/nonexistent/tools.yaml" in p.stderr


def test_gsm8k_interaction_recipe_runs_multi_turn_with_the_shipped_teacher():
    p = _dry("qwen3_8b_gsm8k_interaction.sh", GPU_MEMORY_GB="80")
    assert p.returncode == 0, p.stderr
    cfg = _config(p.stdout)
    ro = cfg["actor_rollout_ref"]["rollout"]
    mt = ro["multi_turn"]
    assert mt["enable"] is True and mt["max_user_turns"] == 5 and mt["tool_config_path"] is None
    assert mt["interaction_config_path"] == str(REPO / "examples" / "interactions" / "gsm8k.yaml")
    assert cfg["data"]["train_files"] == [os.path.expanduser("~/data/gsm8k_interaction/train.parquet")]
    assert cfg["algorithm"]["adv_estimator"] == "grpo" and ro["n"] == 8
    assert "train: TP=2 PP=2 DP=2 | rollout: TP=2 DP=4" in p.stdout and ": FITS" in p.stdout
    p = _dry("qwen3_8b_gsm8k_interaction.sh", INTERACTION_CONFIG="/nonexistent/i.yaml")
    assert p.returncode == 2 and "multi_turn.interaction_config_path" in p.stderr and "/nonexistent/i.yaml" in p.stderr
