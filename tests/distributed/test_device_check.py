"""The CPU device check (MEGAPPO_CHECK_DEVICES=1): a CPU run that fails where a GPU run would.

The first test pins down what the simulation treats as a GPU mistake. The second plants each of
the device bugs found by reading the GPU path (batches never moved to the device, CPU tensors in
NCCL collectives, the value head left on the CPU) back into the real code and shows the check
stops each one, on two DP ranks so every rank fails the same way (no rank left waiting)."""
import os
import sys

import pytest
import torch

from harness import spawn
from mcore import build

pytestmark = pytest.mark.distributed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tiny_models import VOCAB, save_tiny_model  # noqa: E402


def _setup_checked(tp=1, pp=1):
    from megappo import megatron_cpu
    from megappo.models import initialize_parallel

    megatron_cpu.install(check_devices=True)
    assert megatron_cpu.device_check_on()
    initialize_parallel(tp, pp, seed=7)


def _raises(fn, *words):
    from megappo.device_check import DeviceCheckError

    with pytest.raises(DeviceCheckError) as e:
        fn()
    for w in words:
        assert w in str(e.value), (w, str(e.value))
    return str(e.value)


def _semantics_worker(rank, world):
    # The default group exists already (gloo, made by the harness): megatron's groups are made
    # after the install, so its gloo side groups are known as host groups.
    _setup_checked()
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megappo.device_check import DEVICE, HOST, place
    from megappo.distributed import host_dp_group, process_device

    dev = process_device("cpu")
    assert dev == torch.device("cuda", rank)  # LOCAL_RANK, as torchrun sets it
    h = torch.arange(6.0).reshape(2, 3)
    d = h.to(dev)
    assert place(h) == HOST and place(d) == DEVICE
    assert d.device == dev and d.is_cuda and not h.is_cuda and h.device.type == "cpu"
    assert torch.cuda.current_device() == rank
    # values are real CPU values: results equal the unchecked computation
    assert torch.equal((d * 2).cpu(), h * 2) and place(d * 2) == DEVICE and place((d * 2).cpu()) == HOST
    assert place(torch.zeros(3, device=dev)) == DEVICE and place(torch.zeros(3)) == HOST
    assert place(torch.zeros_like(d)) == DEVICE and place(d.new_zeros(2)) == DEVICE
    assert place(torch.ones(2, device=d.device)) == DEVICE  # code that follows its inputs' device
    # what CUDA refuses
    _raises(lambda: d + h, "add", "(2, 3)")
    _raises(lambda: torch.nn.functional.embedding(torch.tensor([[0, 1]]), d), "embedding")
    _raises(lambda: torch.cat([d, h]), "cat")
    _raises(lambda: torch.cat([d.sum(), torch.tensor(1.0)]), "cat")  # no 0-d exception for cat
    _raises(lambda: d.gather(1, torch.zeros(2, 1, dtype=torch.long)), "gather")
    _raises(lambda: torch.nn.Linear(3, 1)(d), "linear")  # a layer whose weights stayed on the host
    # ... and what it allows
    assert torch.equal((d * torch.tensor(2.0)).cpu(), h * 2)  # a 0-d host tensor is a scalar
    buf = torch.empty(2, 3, device=dev)
    buf.copy_(h)  # copies cross devices
    assert torch.equal(d[torch.tensor([1, 0])].cpu(), h[[1, 0]])  # host indices into a device tensor
    buf[torch.tensor([0])] = h[:1]
    assert place(d.float().double()) == DEVICE and place(d.to(torch.float64)) == DEVICE
    assert place(h.to(d)) == DEVICE and place(d.to(h)) == HOST and place(d.to("cpu")) == HOST
    assert place(h.cuda()) == DEVICE and h.cuda().untyped_storage().data_ptr() != h.untyped_storage().data_ptr()

    # collectives: megatron's groups are NCCL on a GPU, its gloo groups are host side groups
    dp, dp_gloo = ps.get_data_parallel_group(), host_dp_group()
    x = torch.ones(2, device=dev)
    dist.all_reduce(x, group=dp)
    assert x.cpu().tolist() == [2.0, 2.0]
    msg = _raises(lambda: dist.all_reduce(torch.ones(2), group=dp), "all_reduce", "NCCL")
    assert "(2,)" in msg
    _raises(lambda: dist.all_reduce(torch.ones(2)), "all_reduce")  # the default group: NCCL on GPU
    _raises(lambda: dist.broadcast(torch.ones(2), src=0), "broadcast")
    _raises(lambda: dist.all_gather([torch.ones(1, device=dev)] * world, torch.ones(1)), "all_gather")
    y = torch.ones(2)
    dist.all_reduce(y, group=dp_gloo)
    assert y.tolist() == [2.0, 2.0]
    _raises(lambda: dist.all_reduce(torch.ones(2, device=dev), group=dp_gloo), "gloo")
    objs = [None] * world
    dist.all_gather_object(objs, {"r": rank, "t": torch.ones(1)}, group=dp)  # objects: torch moves the bytes
    assert [o["r"] for o in objs] == list(range(world))


def test_device_check_semantics():
    spawn(_semantics_worker, 2)


def _batch(n=4, seed=3):
    from megappo.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (6,), generator=g).tolist() for _ in range(n)]
    lengths = torch.randint(2, 7, (n,), generator=g)
    T = int(lengths.max())
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    b = RolloutBatch.from_prompts_and_responses(prompts, torch.randint(3, VOCAB, (n, T), generator=g), mask, 0,
                                                prompt_index=torch.arange(n) // 2)
    b.advantages = torch.randn(n, T, generator=g) * mask
    b.returns = torch.randn(n, T, generator=g) * mask
    return b


def _planted_worker(rank, world, path):
    """Each finding of the GPU review, put back into the real code, is stopped by the check."""
    _setup_checked()
    from unittest import mock

    from megatron.core import parallel_state as ps

    from megappo import algo
    from megappo.batch import RolloutBatch
    from megappo.distributed import host_dp_group
    from megappo.metrics import data_metrics
    from megappo.models import layers
    from megappo.workers import Actor, Critic
    from megappo.workers import MegatronWorker

    info, cfg, chunks = build(path, 1, 1, cpu=False)
    actor = Actor(chunks, cfg, vocab_size=info.desc.vocab_size, lr=0.1, optimizer="sgd",
                  use_distributed_optimizer=False)
    assert actor.device == torch.device("cuda", rank)
    batch = _batch()
    # The fixed code runs clean under the check, and hands results back on the host.
    from megappo.device_check import HOST, place

    batch.old_log_prob = actor.compute_log_prob(batch, micro_batch_size=2)
    assert place(batch.old_log_prob) == HOST
    actor.update_policy(batch, mini_batch_size=4, micro_batch_size=2)
    _, ccfg, cchunks = build(path, 1, 1, value_head=True, cpu=False)
    critic = Critic(cchunks, ccfg, lr=0.1, optimizer="sgd", use_distributed_optimizer=False)
    batch.values = critic.compute_values(batch, micro_batch_size=2)
    assert place(batch.values) == HOST
    critic.update_critic(batch, mini_batch_size=4, micro_batch_size=2)

    # 1. micro-batches never moved to the device: the first stage's embedding refuses host ids.
    with mock.patch.object(MegatronWorker, "_to_device", lambda self, mb, ids: (mb, ids)):
        _raises(lambda: actor.compute_log_prob(batch, micro_batch_size=2), "embedding")
    # ... or only the token ids moved: the losses' index tensors are still on the host.
    with mock.patch.object(RolloutBatch, "to", lambda self, device, non_blocking=False: self):
        _raises(lambda: actor.update_policy(batch, mini_batch_size=4, micro_batch_size=2), "gather")

    # 2a. CPU tensors in the worker's own collectives (NCCL groups on GPU).
    def host_global_sums(self, xs):
        import torch.distributed as dist

        t = torch.tensor(xs, dtype=torch.float64)
        dist.all_reduce(t, group=self.dp_group)
        return t.tolist()

    with mock.patch.object(MegatronWorker, "_global_sums", host_global_sums):
        _raises(lambda: actor.update_policy(batch, mini_batch_size=4, micro_batch_size=2), "all_reduce")
    # 2b. the trainer's host-side math (advantages, KL controller, metrics) on megatron's NCCL group
    dev_dp = ps.get_data_parallel_group()
    scores = batch.advantages
    _raises(lambda: algo.compute_advantages("grpo", token_level_rewards=scores, response_mask=batch.response_mask,
                                            group_index=batch.prompt_index, dp_group=dev_dp), "all_gather")
    _raises(lambda: algo.masked_whiten(scores, batch.response_mask, group=dev_dp), "all_reduce")
    _raises(lambda: data_metrics(batch, 8, group=dev_dp), "all_reduce")
    kl = algo.make_kl_controller({"type": "fixed", "kl_coef": 0.1})
    _raises(lambda: algo.apply_kl_in_reward(scores, scores, scores * 0.5, batch.response_mask, kl,
                                            dp_group=dev_dp), "all_reduce")
    # ... while on the gloo side group they run, and agree with the device-side computation
    host = algo.compute_advantages("grpo", token_level_rewards=scores, response_mask=batch.response_mask,
                                   group_index=batch.prompt_index, dp_group=host_dp_group())[0]
    on_dev = algo.compute_advantages("grpo", token_level_rewards=scores.to(actor.device),
                                     response_mask=batch.response_mask.to(actor.device),
                                     group_index=batch.prompt_index.to(actor.device), dp_group=dev_dp)[0]
    assert torch.allclose(host, on_dev.cpu())

    # 3. the critic's value head created on the CPU: the worker names it at construction ...
    def head_on_cpu(self, config, seed, std=0.0):
        torch.nn.Module.__init__(self)
        self.config, self.sequence_parallel = config, bool(config.sequence_parallel)
        self.weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(1))

    with mock.patch.object(layers.ValueHead, "__init__", head_on_cpu):
        _, ccfg, cchunks = build(path, 1, 1, value_head=True, cpu=False)
    with pytest.raises(ValueError, match="output_layer.weight"):
        Critic(cchunks, ccfg, lr=0.1, optimizer="sgd", use_distributed_optimizer=False)
    # ... and without that guard, the first forward fails as it would on the GPU.
    with mock.patch("megappo.workers.megatron_worker.module_device", lambda chunks: torch.device("cuda", rank)):
        critic = Critic(cchunks, ccfg, use_distributed_optimizer=False)
    _raises(lambda: critic.compute_values(batch, micro_batch_size=2), "linear")


def test_device_check_catches_the_gpu_review_findings(tmp_path):
    save_tiny_model("qwen3", tmp_path / "qwen3")
    spawn(_planted_worker, 2, str(tmp_path / "qwen3"))
