"""The GPU path at world size 1 (one GPU): megappo's workers on CUDA with NCCL, bfloat16, against
transformers on the same GPU; checkpoints and HF export from GPU-resident weights. Each check runs
on megatron's local layer spec and, when TransformerEngine is usable, on TE's spec.

Skipped without CUDA (tests/conftest.py). The logic lives in gpu_checks.py; the same functions
run on CPU under the device check in test_gpu_path_cpu_check.py, so a tensor on the wrong device
is caught before this file ever meets a GPU. Run on a GPU box with ``bash benchmarks/gpu_check.sh``.
"""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_checks  # noqa: E402  (imports torch only; megatron/transformers inside the checks)

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
SPECS = ["local", "te"]


@pytest.fixture(scope="module")
def device():
    dev = torch.device("cuda", 0)
    gpu_checks.init_world(dev)  # NCCL, world size 1, current device cuda:0 (as the trainer does)
    yield dev
    # The checks save checkpoints in this process: megatron's writer keeps a spawned Manager
    # process that would otherwise outlive the session's end-of-run process check.
    from megappo.checkpoint import end_writer_process

    end_writer_process()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpu_path")


def use_te(spec: str) -> bool:
    if spec == "te":
        reason = gpu_checks.te_reason()
        if reason:
            pytest.skip(f"TE layer spec: {reason}")
        return True
    return False


@pytest.mark.parametrize("spec", SPECS)
def test_actor_log_probs_match_transformers_bf16(device, root, spec):
    gpu_checks.check_actor_log_probs(root, device, BF16, use_te(spec))


@pytest.mark.parametrize("dist_opt", [True, False], ids=["dist-opt", "plain-opt"])
@pytest.mark.parametrize("spec", SPECS)
def test_policy_and_critic_update_bf16_follow_fp32(device, root, spec, dist_opt):
    gpu_checks.check_updates(root, device, BF16, use_te(spec), dist_opt=dist_opt)


@pytest.mark.parametrize("spec", SPECS)
def test_reward_model_matches_transformers_bf16(device, root, spec):
    gpu_checks.check_reward_model(root, device, BF16, use_te(spec))


@pytest.mark.parametrize("spec", SPECS)
def test_checkpoint_round_trip_from_gpu(device, root, spec):
    gpu_checks.check_checkpoint(root, device, BF16, use_te(spec))


@pytest.mark.parametrize("spec", SPECS)
def test_hf_export_from_gpu_is_bit_exact(device, root, spec):
    gpu_checks.check_hf_export(root, device, BF16, use_te(spec))


@pytest.mark.parametrize("spec", SPECS)
def test_offload_round_trip_on_gpu(device, root, spec):
    gpu_checks.check_offload(root, device, BF16, use_te(spec))


@pytest.mark.parametrize("spec", SPECS)
def test_packed_sequences_match_the_padded_forward_bf16(device, root, spec):
    """use_remove_padding: THD packing through TransformerEngine's attention (skipped without
    it) or megappo's on the local spec."""
    gpu_checks.check_packed_log_probs(root, device, BF16, use_te(spec))
