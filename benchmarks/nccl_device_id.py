"""What ``init_process_group(device_id=...)`` costs on a GPU at world size 1: with it NCCL makes
every later group's communicator eagerly (by splitting the default one), without it lazily at the
group's first collective. megappo passes no ``device_id`` in either placement; this measures the
difference (GPU memory and seconds for 24 groups, about what megatron makes) on the one-GPU box.

    python benchmarks/nccl_device_id.py        # runs both variants, each in its own process;
                                               # ends with one JSON line: {"lazy": {...}, "eager": {...}}

Measured on one H200 (2026-12-04): eager 9,988 MiB for 24 groups at init; lazy 0 until first use.
"""
import datetime
import os
import socket
import subprocess
import sys
import time

GROUPS = 24


def one(use: bool) -> None:
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    torch.cuda.set_device(0)
    free0 = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    kw = dict(device_id=torch.device("cuda", 0)) if use else {}
    dist.init_process_group("nccl", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60), **kw)
    groups = [dist.new_group([0]) for _ in range(GROUPS)]
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    free1 = torch.cuda.mem_get_info()[0]
    x = torch.ones(1, device="cuda")
    for g in groups:
        dist.all_reduce(x, group=g)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    free2 = torch.cuda.mem_get_info()[0]
    print(f'{{"device_id": {int(use)}, "groups": {GROUPS}, "init_and_groups_s": {t1 - t0:.3f}, '
          f'"mem_after_groups_mib": {(free0 - free1) / 2**20:.0f}, "first_collectives_s": {t2 - t1:.3f}, '
          f'"mem_after_collectives_mib": {(free0 - free2) / 2**20:.0f}}}', flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) > 1:
        one(sys.argv[1] == "1")
    else:   # each variant prints one JSON line; the last line is both, one JSON object
        import json

        import torch

        if not torch.cuda.is_available():
            print("nccl_device_id.py measures NCCL communicators: it needs a CUDA GPU", file=sys.stderr)
            print(json.dumps({"error": "no CUDA device"}))
            sys.exit(2)

        both = {}
        for use in ("0", "1"):
            p = subprocess.run([sys.executable, __file__, use], check=False, timeout=120, capture_output=True, text=True)
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
            print(p.stdout, end="", flush=True)
            both["eager" if use == "1" else "lazy"] = json.loads(lines[-1]) if lines else {"error": p.stderr[-500:]}
        print(json.dumps(both))
