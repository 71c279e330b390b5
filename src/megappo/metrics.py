"""verl-named metrics of a step's batch, timers, and the metric sinks (console, tensorboard, file)."""
from __future__ import annotations

import json
import os
import secrets
import re
import sys
import time
from contextlib import contextmanager
from typing import Optional

import torch

from megappo.batch import RolloutBatch

__all__ = ["data_metrics", "critic_diagnostics", "CollapseWatch", "Timer", "MetricsLogger", "peak_flops", "mfu",
           "select_generations", "generation_records", "dump_generations"]

# Dense bf16 tensor-core peak per GPU in TFLOPS, keyed by words of torch.cuda.get_device_name().
# NVIDIA's datasheets lead with the 2:4-sparse figure; dense is half of it. One form factor's name
# carries no suffix ("NVIDIA H100 80GB HBM3" is the SXM part), so a suffixed key must outrank it:
# the key with the most matching words wins. Whole words, so "H20" is not read in "H200"/"GH200",
# "B200" not in "GB200", "L4" not in "L40S".
_PEAK_BF16_TFLOPS = {
    # GB200 NVL72 and HGX B200 specifications: 5 and 4.5 PFLOPS sparse per GPU
    ("gb200",): 2500, ("b200",): 2250,
    # Hopper whitepaper: SXM5 989.4, PCIe 756.5; H100 datasheet: NVL 1,671 sparse. H800 SXM/PCIe are
    # export variants of those parts (less NVLink bandwidth) with the same bf16 tensor-core peaks.
    ("h100",): 989.4, ("h100", "pcie"): 756.5, ("h100", "nvl"): 835,
    ("h800",): 989.4, ("h800", "pcie"): 756.5,
    # H200 datasheet: SXM 1,979, NVL 1,671 sparse; GH200 datasheet: 1,979 sparse
    ("h200",): 989, ("h200", "nvl"): 835, ("gh200",): 989,
    ("h20",): 148,  # NVIDIA's H20 specification (China export part, no public datasheet)
    ("a100",): 312, ("a800",): 312,  # A100 datasheet, SXM4 and PCIe alike: 312 | 624 sparse
    # L40S datasheet 362.05; L40 datasheet 181.05 | 362.1 sparse; L4 datasheet 242 sparse
    ("l40s",): 362, ("l40",): 181, ("l4",): 121,
    ("a10g",): 70,  # AWS-only part without an NVIDIA datasheet: the figure in common use, unverified
}


def peak_flops(device_name: str) -> Optional[float]:
    """Peak dense bf16 FLOP/s of one GPU by its name (torch.cuda.get_device_name); None if unknown."""
    words = set(re.split(r"[^0-9a-z]+", device_name.lower()))
    matches = [key for key in _PEAK_BF16_TFLOPS if words.issuperset(key)]
    if not matches:
        return None
    return _PEAK_BF16_TFLOPS[max(matches, key=len)] * 1e12


def mfu(n_params: int, tokens: float, seconds: float, n_gpus: int, peak: float) -> float:
    """Model FLOPs utilisation of a training pass: 6 FLOPs per parameter per token (forward +
    backward, attention ignored as is usual for short sequences) over the GPUs' peak."""
    return 6.0 * n_params * tokens / (seconds * n_gpus * peak)


def _reduce(vals: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(vals, op=op, group=group)
    return vals


def _stats(prefix: str, x: torch.Tensor, mask: Optional[torch.Tensor] = None, group=None) -> dict:
    """mean/max/min over the selected elements of every rank of ``group`` (None: this rank)."""
    v = (x[mask.bool()] if mask is not None else x.reshape(-1)).double().cpu()
    ReduceOp = torch.distributed.ReduceOp
    sums = _reduce(torch.tensor([v.sum().item(), float(v.numel())], dtype=torch.float64), ReduceOp.SUM, group)
    inf = float("inf")
    hi = _reduce(torch.tensor([v.max().item() if v.numel() else -inf], dtype=torch.float64), ReduceOp.MAX, group)
    lo = _reduce(torch.tensor([v.min().item() if v.numel() else inf], dtype=torch.float64), ReduceOp.MIN, group)
    if sums[1] == 0:
        return {f"{prefix}/mean": 0.0, f"{prefix}/max": 0.0, f"{prefix}/min": 0.0}
    return {f"{prefix}/mean": (sums[0] / sums[1]).item(), f"{prefix}/max": hi.item(), f"{prefix}/min": lo.item()}


def _explained_var(returns: torch.Tensor, values: torch.Tensor, group=None) -> float:
    """1 - Var(returns - values) / Var(returns) over response tokens of all ranks (population
    variances from summed moments, so the DP split does not change the figure)."""
    r, d = returns.double().cpu(), (returns - values).double().cpu()
    m = _reduce(torch.tensor([float(r.numel()), r.sum(), (r * r).sum(), d.sum(), (d * d).sum()], dtype=torch.float64),
                torch.distributed.ReduceOp.SUM, group)
    n = m[0].item()
    if n < 2:
        return 0.0
    var_r = m[2].item() / n - (m[1].item() / n) ** 2
    var_d = m[4].item() / n - (m[3].item() / n) ** 2
    return 1.0 - var_d / (var_r + 1e-5)


def _position_buckets(max_response_length: int) -> list[tuple[int, int]]:
    """Response positions 0, 1, 2-3, 4-7, ... up to ``max_response_length`` (same on every rank)."""
    out, lo = [], 0
    while lo < max_response_length:
        hi = min(max(lo * 2, 1), max_response_length) - 1 if lo else 0
        out.append((lo, hi))
        lo = hi + 1
    return out


def critic_diagnostics(batch: RolloutBatch, max_response_length: int, group=None) -> dict:
    """What tells a user why a critic does or does not help, over response tokens of every rank
    of ``group`` (collective):

    - ``critic/values/std`` next to ``critic/returns/std``: the value head's output scale against
      the returns'. A head whose values dwarf the returns (a random head at the start) drowns the
      advantage in its own noise.
    - ``critic/advantages_returns_corr``: Pearson correlation of advantages and returns over
      tokens; near 0 when the advantage is mostly the critic's noise.
    - ``critic/advantages/pos_<a>-<b>``: the mean advantage at response positions a..b (buckets
      0, 1, 2-3, 4-7, ...): where in the response the signal sits.
    """
    m = batch.response_mask.double()
    keep = m.bool()
    A = batch.advantages
    R = batch.returns
    V = batch.values
    buckets = _position_buckets(max_response_length)
    pos = torch.arange(m.shape[1])
    acc = []
    for x in (V, R):
        x = x.double()[keep] if x is not None else torch.zeros(0, dtype=torch.float64)
        acc += [float(x.numel()), x.sum().item(), (x * x).sum().item()]
    if A is not None and R is not None:
        a, r = A.double()[keep], R.double()[keep]
        acc += [float(a.numel()), a.sum().item(), r.sum().item(), (a * a).sum().item(), (r * r).sum().item(),
                (a * r).sum().item()]
    else:
        acc += [0.0] * 6
    if A is not None:
        for lo, hi in buckets:
            sel = keep & ((pos >= lo) & (pos <= hi))[None, :]
            acc += [A.double()[sel].sum().item(), float(sel.sum())]
    t = _reduce(torch.tensor(acc, dtype=torch.float64), torch.distributed.ReduceOp.SUM, group).tolist()

    def std(n, s1, s2):
        return max(s2 / n - (s1 / n) ** 2, 0.0) ** 0.5 if n else 0.0

    out = {}
    if V is not None:
        out["critic/values/std"] = std(*t[0:3])
    if R is not None:
        out["critic/returns/std"] = std(*t[3:6])
    n, sa, sr, saa, srr, sar = t[6:12]
    if A is not None and R is not None:
        cov = sar / n - (sa / n) * (sr / n) if n else 0.0
        da, dr = std(n, sa, saa), std(n, sr, srr)
        out["critic/advantages_returns_corr"] = cov / (da * dr) if da > 0 and dr > 0 else 0.0
    if A is not None:
        for i, (lo, hi) in enumerate(buckets):
            s_, c = t[12 + 2 * i], t[13 + 2 * i]
            out[f"critic/advantages/pos_{lo}" + (f"-{hi}" if hi > lo else "")] = s_ / c if c else 0.0
    return out


class CollapseWatch:
    """Names the failure in which the policy sharpens without learning: ``actor/entropy`` fell
    below half its first value while ``critic/score/mean`` (a 5-step running mean) gained less
    than its start's size (it stayed under twice its start) AND less than a quarter of the way
    from its start to the best sample score seen so far (``critic/score/max``, when logged).
    The second clause is for runs that start competent: a policy at 0.4 that learns to 0.8 and
    sharpens on the way cannot double its score (measured: every run of copy from a warm start
    would have been named). :meth:`update` returns a message the first time it happens (then None)."""

    def __init__(self, window: int = 5):
        self.window, self.entropy0, self.scores, self.fired, self.best = window, None, [], False, None

    def update(self, metrics: dict):
        entropy, score = metrics.get("actor/entropy"), metrics.get("critic/score/mean")
        if entropy is None or score is None or self.fired:
            return None
        if self.entropy0 is None:
            self.entropy0 = entropy
        self.scores.append(score)
        best = metrics.get("critic/score/max")
        if best is not None:
            self.best = best if self.best is None else max(self.best, best)
        if len(self.scores) < 2 * self.window:
            return None
        start = sum(self.scores[:self.window]) / self.window
        now = sum(self.scores[-self.window:]) / self.window
        needed = max(abs(start), 1e-6)                      # twice the start (scores near 0)
        if self.best is not None:
            needed = min(needed, max(self.best - start, 0.0) / 4)   # or a quarter of the headroom seen
        if entropy < 0.5 * self.entropy0 and now - start < needed:
            self.fired = True
            share = metrics.get("critic/advantages/equal_score_share")
            return (f"actor/entropy fell from {self.entropy0:.3g} to {entropy:.3g} while critic/score/mean stayed at "
                    f"{now:.3g} (start {start:.3g}): the policy is sharpening without learning"
                    + (f"; critic/advantages/equal_score_share {share:.2f} of the advantage sits on prompts whose "
                       "samples all scored alike (the critic's noise): try algorithm.gae_adv_norm=group_cv"
                       if share is not None else ""))
        return None


def data_metrics(batch: RolloutBatch, max_response_length: int, group=None) -> dict:
    """critic/score, critic/rewards, critic/advantages, critic/returns, critic/values (+
    vf_explained_var), response_length/* (with clip_ratio: share of responses that hit the
    length limit), prompt_length/* -- over the samples of every rank of ``group`` (each rank
    passes its own, disjoint samples; None: this rank's batch alone). Collective over ``group``."""
    m = batch.response_mask
    out = {}
    if batch.token_level_scores is not None:
        out.update(_stats("critic/score", (batch.token_level_scores * m).sum(-1), group=group))
    if batch.token_level_rewards is not None:
        out.update(_stats("critic/rewards", (batch.token_level_rewards * m).sum(-1), group=group))
    if batch.advantages is not None:
        out.update(_stats("critic/advantages", batch.advantages, m, group=group))
    if batch.returns is not None:
        out.update(_stats("critic/returns", batch.returns, m, group=group))
    if batch.values is not None:
        out.update(_stats("critic/values", batch.values, m, group=group))
        if batch.returns is not None:
            out["critic/vf_explained_var"] = _explained_var(batch.returns[m.bool()], batch.values[m.bool()], group)
    if batch.advantages is not None or batch.values is not None:
        out.update(critic_diagnostics(batch, max_response_length, group))
    lengths = batch.valid_mask.sum(-1)   # tool turns included, as verl's (from the attention mask)
    out.update(_stats("response_length", lengths, group=group))
    out["response_length/clip_ratio"] = _stats("clip", (lengths >= max_response_length).double(), group=group)["clip/mean"]
    out.update(_stats("prompt_length", batch.prompt_lengths.double(), group=group))
    return out


class Timer:
    """``with timer("gen"): ...`` records ``timing_s/gen``; ``timing_s/step`` spans a whole step."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        from megappo import watchdog

        t = time.perf_counter()
        try:
            with watchdog.phase(name):   # the phase a silent rank was last in
                yield
        finally:
            self.times[f"timing_s/{name}"] = self.times.get(f"timing_s/{name}", 0.0) + time.perf_counter() - t

    def pop(self) -> dict:
        out, self.times = self.times, {}
        return out


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class _WandbSink:
    """verl's naming: project = trainer.project_name, run name = trainer.experiment_name, the
    resolved config as the run's config. The run id is kept in ``<run_dir>/wandb_run_id`` so a
    resumed job continues the same run. Offline: ``WANDB_MODE=offline`` (wandb's own switch)."""

    def __init__(self, run_dir: str, project: str, experiment: str, config: dict):
        import wandb

        id_file = os.path.join(run_dir, "wandb_run_id")
        run_id = open(id_file).read().strip() if os.path.exists(id_file) else secrets.token_hex(4)
        with open(id_file, "w") as f:
            f.write(run_id)
        self.run = wandb.init(project=project, name=experiment, id=run_id, resume="allow", config=config,
                              dir=run_dir)
        self.rows: list = []   # val/generations' rows

    def log(self, step: int, scalars: dict) -> None:
        self.run.log(scalars, step=step)

    def log_generations(self, step: int, samples: list) -> None:
        """verl's table: one row per validation (step, then input, output and score of each
        sample), the rows so far logged together (wandb keeps a table's last version)."""
        import wandb

        self.rows.append([step] + [x for sample in samples for x in sample])
        columns = ["step"] + [f"{c}_{i + 1}" for i in range(len(samples)) for c in ("input", "output", "score")]
        self.run.log({"val/generations": wandb.Table(columns=columns, data=self.rows)}, step=step)

    def close(self) -> None:
        self.run.finish()


class _MlflowSink:
    """verl's naming: experiment = trainer.project_name, run name = trainer.experiment_name, the
    flattened config as parameters. Tracking store: ``MLFLOW_TRACKING_URI`` if set, else a local
    store in ``<run_dir>/mlruns``. A resumed job continues the same run (id in
    ``<run_dir>/mlflow_run_id``). MLflow rejects '@' in metric names: it becomes '_at_' as in verl."""

    def __init__(self, run_dir: str, project: str, experiment: str, config: dict):
        import mlflow

        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # MLflow 3 keeps its file store in "maintenance mode" behind this switch; a local
            # store needs no server and no database packages (mlflow-skinny has none).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri("file://" + os.path.abspath(os.path.join(run_dir, "mlruns")))
        id_file = os.path.join(run_dir, "mlflow_run_id")
        if os.path.exists(id_file):
            self.run = mlflow.start_run(run_id=open(id_file).read().strip())
        else:
            mlflow.set_experiment(project)
            self.run = mlflow.start_run(run_name=experiment)
            with open(id_file, "w") as f:
                f.write(self.run.info.run_id)
            params = {k: str(v)[:500] for k, v in _flat(config).items()}
            items = list(params.items())
            for i in range(0, len(items), 100):  # mlflow's batch limit
                mlflow.log_params(dict(items[i:i + 100]))

    def log(self, step: int, scalars: dict) -> None:
        self.mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in scalars.items()}, step=step)

    def log_generations(self, step: int, samples: list) -> None:
        """One JSON artifact per validation: val_generations/step_<step>.json."""
        self.mlflow.log_dict({"step": step, "samples": [dict(zip(("input", "output", "score"), x)) for x in samples]},
                             f"val_generations/step_{step}.json")

    def close(self) -> None:
        self.mlflow.end_run()


GENERATIONS_FILE = "val_generations.jsonl"


def select_generations(samples: list, n: int) -> list:
    """The ``n`` validation samples ``(input, output, score)`` to log, chosen as verl chooses
    them: sorted by input (stable), shuffled by numpy's RandomState(42), the first ``n``; the
    same prompts at every validation of a run."""
    import numpy as np

    if n <= 0:
        return []
    chosen = sorted(samples, key=lambda x: x[0])
    np.random.RandomState(42).shuffle(chosen)
    return chosen[:n]


def generation_records(tokenizer, batch, items, scores, details: Optional[list] = None) -> list[dict]:
    """One record per sample as verl dumps them (trainer.rollout_data_dir, validation_data_dir):
    ``input`` (the prompt) and ``output`` (the response, tool turns included) decoded without
    special tokens, ``gts`` (the row's ground truth), ``score``; then what the reward function
    returned beside its score (``details``: its dict per sample, or None)."""
    lengths = batch.response_lengths
    out = []
    for i in range(len(batch)):
        rec = {"input": tokenizer.decode(items[i].prompt_ids, skip_special_tokens=True),
               "output": tokenizer.decode(batch.responses[i, :int(lengths[i])].tolist(), skip_special_tokens=True),
               "gts": items[i].ground_truth, "score": float(scores[i])}
        extra = details[i] if details is not None else None
        if isinstance(extra, dict):
            rec.update((k, v) for k, v in extra.items() if k not in rec)
        out.append(rec)
    return out


def dump_generations(directory: str, step: int, records: list[dict]) -> str:
    """``<directory>/<step>.jsonl``: one JSON line per record, with its ``step`` (verl's layout;
    a step written again, after a resume, is replaced). Returns the file's path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{step}.jsonl")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            row = {**{k: v for k, v in rec.items() if k in ("input", "output", "gts", "score")}, "step": step,
                   **{k: v for k, v in rec.items() if k not in ("input", "output", "gts", "score")}}
            f.write(json.dumps(row, ensure_ascii=False, default=_plain_json) + "\n")
    os.replace(tmp, path)
    return path


def _plain_json(x):
    """JSON for what reward functions return beyond plain types (numpy numbers and arrays, tensors)."""
    if hasattr(x, "tolist"):
        return x.tolist()
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def _md(text: str) -> str:
    """Text shown verbatim in TensorBoard's markdown: as a code span (backticks doubled away)."""
    return "``" + text.replace("`", "'") + "``"


def _keep_steps(path: str, step: int) -> None:
    """Drop a JSON-lines file's records of steps after ``step`` (and lines cut short)."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                if json.loads(line)["step"] <= step:
                    keep.append(line)
            except (ValueError, KeyError):
                pass  # a line cut short by the crash
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(keep)
    os.replace(tmp, path)


class MetricsLogger:
    """Writes each step's metrics to the sinks named in ``trainer.logger``: ``console`` (one line
    per step), ``tensorboard`` (event files in ``<run_dir>/tensorboard``), ``file``
    (``<run_dir>/metrics.jsonl``, one JSON object per step), ``wandb`` and ``mlflow`` (optional
    packages; verl's project/experiment naming). Call on every rank; only rank 0 writes."""

    SINKS = ("console", "tensorboard", "file", "wandb", "mlflow")

    def __init__(self, sinks, run_dir: str, rank: int = 0, total_steps: Optional[int] = None, stream=None,
                 project: str = "megappo", experiment: str = "default", config: Optional[dict] = None):
        self.run_dir = run_dir
        self._resumed_at = 0
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
        self._remote = []
        if "wandb" in self.sinks:
            self._remote.append(_WandbSink(run_dir, project, experiment, config or {}))
        if "mlflow" in self.sinks:
            self._remote.append(_MlflowSink(run_dir, project, experiment, config or {}))

    def log(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if "console" in self.sinks:
            eta = ""
            if self.total:
                done = step - self._resumed_at
                per = (time.time() - self.t0) / max(done, 1)
                eta = f" eta {per * max(self.total - step, 0):.0f}s"
            keys = [k for k in ("critic/score/mean", "actor/pg_loss", "critic/vf_loss", "response_length/mean",
                                "timing_s/step") if k in scalars] + sorted(k for k in scalars if k.startswith("val-core/"))
            shown = " ".join(f"{k}={scalars[k]:.4g}" for k in keys)
            bar = f"[{step}/{self.total}]" if self.total else f"[{step}]"
            if self.total:
                done = int(20 * min(step, self.total) / self.total)
                bar = f"{bar} |{'#' * done}{'.' * (20 - done)}|"
            print(f"step {bar}{eta} {shown}", file=self.stream, flush=True)
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._file is not None:
            self._file.write(json.dumps({"step": step, **scalars}) + "\n")
            self._file.flush()
        for sink in self._remote:
            sink.log(step, scalars)

    def log_generations(self, step: int, samples: list) -> None:
        """Validation samples ``(input, output, score)`` (trainer.log_val_generations of them, see
        :func:`select_generations`): ``file`` appends one JSON line per sample to
        ``<run_dir>/val_generations.jsonl``, ``tensorboard`` a text entry ``val/generations``,
        ``wandb`` verl's table, ``mlflow`` a JSON artifact; ``console`` prints nothing (as verl)."""
        if not self.active or not samples:
            return
        if "file" in self.sinks:
            with open(os.path.join(self.run_dir, GENERATIONS_FILE), "a", encoding="utf-8") as f:
                for inp, out, score in samples:
                    f.write(json.dumps({"step": step, "input": inp, "output": out, "score": score}) + "\n")
        if self._tb is not None:
            text = "\n\n".join(f"**input** {_md(inp)}\n\n**output** {_md(out)}\n\n**score** {score:g}"
                                for inp, out, score in samples)
            self._tb.add_text("val/generations", text, step)
            self._tb.flush()
        for sink in self._remote:
            sink.log_generations(step, samples)

    def truncate_after(self, step: int) -> None:
        """On resume: drop what a crashed run logged after its last checkpoint, so each step
        appears once (the files keep their lines up to ``step``; TensorBoard purges later events)."""
        self.t0 = time.time()
        self._resumed_at = step
        if not self.active:
            return
        if self._file is not None:
            path = self._file.name
            self._file.close()
            _keep_steps(path, step)
            self._file = open(path, "a", encoding="utf-8")
            _keep_steps(os.path.join(self.run_dir, GENERATIONS_FILE), step)
        if self._tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()
            self._tb = SummaryWriter(os.path.join(self.run_dir, "tensorboard"), purge_step=step + 1)

    def close(self) -> None:
        for sink in getattr(self, "_remote", []):
            sink.close()
        if self._tb is not None:
            self._tb.close()
        if self._file is not None:
            self._file.close()
