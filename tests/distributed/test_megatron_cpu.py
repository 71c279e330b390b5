"""megappo.megatron_cpu: each piece is needed (megatron fails without it) and works (with it).

Each "needed" case runs in fresh spawned processes, since the pieces patch process-global state;
the "works" cases share one world, all with the same (whole) shim."""
import os
import sys

import pytest
import torch

from harness import raise_if_failed, spawn, spawn_each

pytestmark = pytest.mark.distributed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tiny(tp=1, pp=1, sp=False):
    from tiny_models import hf_config

    from megappo.models import build_model, describe, transformer_config

    info = describe(hf_config("qwen3", num_hidden_layers=2), tp=tp)
    cfg = transformer_config(info, tp=tp, pp=pp, sequence_parallel=sp, cpu=True)
    chunks = build_model(info, cfg)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        for p in chunks[0].parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return cfg, chunks


def _op_seed(rank, world):
    from megappo.models import initialize_parallel

    initialize_parallel(1, 1, seed=3)


def _op_forward(rank, world):
    from megappo.models import initialize_parallel

    initialize_parallel(1, 1)
    _, chunks = _tiny()
    ids = torch.randint(0, 100, (2, 8))
    out = chunks[0](ids, torch.arange(8)[None].expand(2, 8), attention_mask=None)
    assert out.shape[:2] == (2, 8) and torch.isfinite(out).all()


def _op_sp_backward(rank, world):
    from megappo.models import initialize_parallel

    initialize_parallel(2, 1)
    _, chunks = _tiny(tp=2, sp=True)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    out = chunks[0](ids, torch.arange(8)[None].expand(2, 8), attention_mask=None)
    out.float().pow(2).mean().backward()
    assert all(p.grad is not None for p in chunks[0].parameters())


def _op_pp_schedule(rank, world):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megappo.models import initialize_parallel

    initialize_parallel(1, 2)
    _, chunks = _tiny(pp=2)
    batches = iter([torch.randint(0, 100, (2, 8)) for _ in range(2)])

    def step(it, model):
        ids = next(it)
        out = model(ids, torch.arange(8)[None].expand(2, 8), attention_mask=None)
        return out, lambda o: (o.float().mean(), {"m": o.float().mean().detach()})

    out = get_forward_backward_func()(forward_step_func=step, data_iterator=batches, model=chunks[0],
                                      num_microbatches=2, seq_length=8, micro_batch_size=2, forward_only=True)
    assert len(out) == (2 if ps.is_pipeline_last_stage() else 0)


def _op_optimizer(rank, world):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megappo.models import initialize_parallel

    initialize_parallel(1, 1)
    cfg, chunks = _tiny()
    ddp = [DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True), c) for c in chunks]
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True), ddp)
    assert opt is not None


def _moe_forward(ep):
    from megappo.models import build_model, describe, initialize_parallel, transformer_config
    from tiny_models import hf_config

    initialize_parallel(1, 1, ep=ep)
    info = describe(hf_config("qwen3_moe", num_hidden_layers=2))
    chunks = build_model(info, transformer_config(info, cpu=True, ep=ep))
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(0))
    out = chunks[0](ids, torch.arange(8)[None].expand(2, 8), attention_mask=None)
    assert torch.isfinite(out).all()


def _op_moe_ep1(rank, world):
    _moe_forward(1)


def _op_moe_ep2(rank, world):
    _moe_forward(2)


# piece -> (what needs it, processes, what megatron's failure without it says)
OPS = {"rng": (_op_seed, 1, "cuda"), "device": (_op_forward, 1, "cuda"), "backward": (_op_sp_backward, 2, "cuda"),
       "sync": (_op_pp_schedule, 2, "cuda"), "tensor_type": (_op_optimizer, 1, "cuda"),
       "streams": (_op_moe_ep1, 1, "cuda"), "moe_splits": (_op_moe_ep2, 2, "split")}


def _worker(rank, world, missing, op_name):
    from megappo import megatron_cpu

    pieces = [p for p in megatron_cpu.PIECES if p != missing]
    megatron_cpu.install(pieces)
    op, _, says = OPS[op_name]
    if missing is None:
        op(rank, world)
        return
    try:
        op(rank, world)
    except (AssertionError, RuntimeError, TypeError, ValueError) as e:
        msg = str(e).lower()
        assert says in msg or "accelerator" in msg, f"failed without '{missing}', but not for that: {e!r}"
        os._exit(0)  # peers may be blocked in a collective; the failure is what we expected
    raise AssertionError(f"megatron worked without the '{missing}' piece: it is not needed")


@pytest.mark.parametrize("piece", list(OPS))
def test_piece_is_needed(piece):
    op, world, _ = OPS[piece]
    spawn(_worker, world, piece, piece)


@pytest.fixture(scope="module")
def with_every_piece(tmp_path_factory):
    """Every case with the whole shim installed, in one world of 2 (world-1 cases run as DP 2):
    the same process-global state for all of them, so they can share it. piece -> error file."""
    root = tmp_path_factory.mktemp("pieces")
    errors = {piece: str(root / f"{piece}.error") for piece in OPS}
    spawn_each(2, [(_worker, (None, piece), errors[piece]) for piece in OPS])
    return errors


@pytest.mark.parametrize("piece", list(OPS))
def test_piece_works(piece, with_every_piece):
    raise_if_failed(with_every_piece[piece])


def test_unknown_piece_and_idempotence():
    from megappo import megatron_cpu

    with pytest.raises(ValueError, match="unknown megatron_cpu pieces"):
        megatron_cpu.install(["nope"])


def test_every_piece_has_its_case():
    from megappo import megatron_cpu

    assert sorted(OPS) == sorted(megatron_cpu.PIECES)


def _after_vllm_worker(rank, world):
    from megappo import megatron_cpu

    megatron_cpu.install()
    import torch

    import vllm.v1.worker.cpu.shm  # noqa: F401  replaces torch.cuda.Stream/Event with placeholders
    assert torch.cuda.Stream().record_event() is None       # what broke the dispatcher's sync
    _moe_forward(1)


def test_moe_dispatch_survives_vllms_cpu_stream_placeholders():
    """The trainer starts vLLM (whose CPU worker swaps torch.cuda's streams for placeholders
    returning no events) after installing the shim, then builds MoE models: the alltoall
    dispatcher's device-to-host stream stays the shim's."""
    spawn(_after_vllm_worker, 1)
