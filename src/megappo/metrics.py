"""verl-named metrics of a step's batch, timers, and the metric sinks (console, tensorboard, file)."""
from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from typing import Optional

import torch

from megappo.batch import RolloutBatch

__all__ = ["data_metrics", "Timer", "MetricsLogger"]


def _stats(prefix: str, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> dict:
    v = x[mask.bool()] if mask is not None else x.reshape(-1)
    if v.numel() == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    v = v.double()
    return {f"{prefix}/mean": v.mean().item(), f"{prefix}/max": v.max().item(), f"{prefix}/min": v.min().item()}


def data_metrics(batch: RolloutBatch, max_response_length: int) -> dict:
    """critic/score, critic/rewards, critic/advantages, critic/returns, critic/values (+
    vf_explained_var), response_length/* (with clip_ratio: share of responses that hit the
    length limit), prompt_length/* -- over this rank's samples."""
    m = batch.response_mask
    out = {}
    if batch.token_level_scores is not None:
        out.update(_stats("critic/score", (batch.token_level_scores * m).sum(-1)))
    if batch.token_level_rewards is not None:
        out.update(_stats("critic/rewards", (batch.token_level_rewards * m).sum(-1)))
    if batch.advantages is not None:
        out.update(_stats("critic/advantages", batch.advantages, m))
    if batch.returns is not None:
        out.update(_stats("critic/returns", batch.returns, m))
    if batch.values is not None:
        out.update(_stats("critic/values", batch.values, m))
        if batch.returns is not None:
            ret, val = batch.returns[m.bool()].double(), batch.values[m.bool()].double()
            var = ret.var(unbiased=False) if ret.numel() > 1 else torch.tensor(0.0, dtype=torch.float64)
            ev = 1.0 - ((ret - val).var(unbiased=False) / (var + 1e-5)) if ret.numel() > 1 else torch.tensor(0.0)
            out["critic/vf_explained_var"] = float(ev)
    lengths = m.sum(-1)
    out.update(_stats("response_length", lengths))
    out["response_length/clip_ratio"] = (lengths >= max_response_length).double().mean().item()
    out.update(_stats("prompt_length", batch.prompt_lengths.double()))
    return out


class Timer:
    """``with timer("gen"): ...`` records ``timing_s/gen``; ``timing_s/step`` spans a whole step."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"timing_s/{name}"] = self.times.get(f"timing_s/{name}", 0.0) + time.perf_counter() - t

    def pop(self) -> dict:
        out, self.times = self.times, {}
        return out


class MetricsLogger:
    """Writes each step's metrics to the sinks named in ``trainer.logger``: ``console`` (one line
    per step), ``tensorboard`` (event files in ``<run_dir>/tensorboard``) and ``file``
    (``<run_dir>/metrics.jsonl``, one JSON object per step). Call on every rank; only rank 0 writes."""

    SINKS = ("console", "tensorboard", "file")

    def __init__(self, sinks, run_dir: str, rank: int = 0, total_steps: Optional[int] = None, stream=None):
        unknown = set(sinks) - set(self.SINKS)
        if unknown:
            raise ValueError(f"trainer.logger: unknown sinks {sorted(unknown)}; known: {', '.join(self.SINKS)}")
        self.active = rank == 0
        self.sinks = list(sinks)
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.t0 = time.time()
        self._tb = None
        self._file = None
        if not self.active:
            return
        os.makedirs(run_dir, exist_ok=True)
        if "tensorboard" in self.sinks:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        if "file" in self.sinks:
            self._file = open(os.path.join(run_dir, "metrics.jsonl"), "a", encoding="utf-8")

    def log(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if "console" in self.sinks:
            eta = ""
            if self.total:
                per = (time.time() - self.t0) / max(step, 1)
                eta = f" eta {per * (self.total - step):.0f}s"
            keys = [k for k in ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "response_length/mean",
                                "timing_s/step") if k in scalars]
            shown = " ".join(f"{k}={scalars[k]:.4g}" for k in keys)
            bar = f"[{step}/{self.total}]" if self.total else f"[{step}]"
            print(f"step {bar}{eta} {shown}", file=self.stream, flush=True)
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._file is not None:
            self._file.write(json.dumps({"step": step, **scalars}) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
