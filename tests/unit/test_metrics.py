"""verl-named batch metrics and the metric sinks."""
import io
import json

import pytest
import torch

from megappo.batch import RolloutBatch
from megappo.metrics import MetricsLogger, Timer, data_metrics


def batch():
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    b = RolloutBatch.from_prompts_and_responses([[1, 2], [3, 4, 5], [6]], torch.ones(3, 4, dtype=torch.long), mask, 0)
    b.token_level_scores = torch.zeros(3, 4)
    b.token_level_scores[0, 2], b.token_level_scores[1, 3], b.token_level_scores[2, 0] = 1.0, 0.0, 0.5
    b.token_level_rewards = b.token_level_scores - 0.1 * mask
    b.advantages = torch.arange(12.0).view(3, 4)
    b.returns = torch.ones(3, 4) * 2
    b.values = torch.ones(3, 4)
    return b


def test_data_metrics():
    m = data_metrics(batch(), max_response_length=4)
    assert m["critic/score/mean"] == pytest.approx(0.5) and m["critic/score/max"] == 1.0 and m["critic/score/min"] == 0.0
    assert m["critic/rewards/mean"] == pytest.approx(0.5 - 0.1 * 8 / 3)
    assert m["critic/advantages/max"] == 8.0 and m["critic/advantages/min"] == 0.0   # masked entries ignored
    assert m["response_length/mean"] == pytest.approx(8 / 3) and m["response_length/max"] == 4
    assert m["response_length/clip_ratio"] == pytest.approx(1 / 3)
    assert m["prompt_length/mean"] == pytest.approx(2.0)
    assert m["critic/vf_explained_var"] == pytest.approx(1 - 0 / (0 + 1e-5))  # constant error: var(ret - v) = 0
    b = batch()
    b.values = b.returns.clone()
    assert data_metrics(b, 4)["critic/vf_explained_var"] == pytest.approx(1.0)


def test_timer():
    t = Timer()
    with t("gen"):
        pass
    with t("gen"):
        pass
    out = t.pop()
    assert set(out) == {"timing_s/gen"} and out["timing_s/gen"] >= 0 and t.pop() == {}


def test_logger_sinks(tmp_path):
    stream = io.StringIO()
    lg = MetricsLogger(["console", "tensorboard", "file"], str(tmp_path), total_steps=10, stream=stream)
    lg.log(1, {"critic/score/mean": 0.25, "actor/pg_loss": -0.1, "note": "x", "flag": True})
    lg.log(2, {"critic/score/mean": 0.5})
    lg.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "critic/score/mean": 0.25, "actor/pg_loss": -0.1}, {"step": 2, "critic/score/mean": 0.5}]
    assert "step [1/10]" in stream.getvalue() and "critic/score/mean=0.25" in stream.getvalue()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "tensorboard"))
    ea.Reload()
    assert [e.value for e in ea.Scalars("critic/score/mean")] == [0.25, 0.5]
    with pytest.raises(ValueError, match="unknown sinks \\['neptune'\\]"):
        MetricsLogger(["neptune"], str(tmp_path))
    quiet = MetricsLogger(["file"], str(tmp_path / "other"), rank=1)
    quiet.log(1, {"a": 1.0})
    assert not (tmp_path / "other").exists()


def test_logger_resume_drops_steps_after_the_checkpoint(tmp_path):
    lg = MetricsLogger(["tensorboard", "file"], str(tmp_path), total_steps=4, stream=io.StringIO())
    for step in (1, 2, 3):
        lg.log(step, {"x": float(step)})
    lg.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "x"')  # a line torn by the crash
    resumed = MetricsLogger(["tensorboard", "file"], str(tmp_path), total_steps=4, stream=io.StringIO())
    resumed.truncate_after(2)
    resumed.log(3, {"x": 30.0})
    resumed.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == [{"step": 1, "x": 1.0}, {"step": 2, "x": 2.0}, {"step": 3, "x": 30.0}]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "tensorboard"))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("x")] == [(1, 1.0), (2, 2.0), (3, 30.0)]


def test_select_generations_picks_as_verl():
    """verl's choice written another way: sort the triples by input, a permutation of numpy's
    RandomState(42) over them, the first n; independent of the order they arrive in."""
    import random

    import numpy as np

    from megappo.metrics import select_generations

    samples = [(f"prompt {i:02d}", f"answer {i}", i / 10) for i in range(20)]
    shuffled = samples[:]
    random.Random(3).shuffle(shuffled)
    order = np.random.RandomState(42).permutation(20)   # shuffle() and permutation() draw alike
    want = [samples[j] for j in order[:5]]
    assert select_generations(shuffled, 5) == want
    assert select_generations(samples, 5) == want and select_generations(samples, 0) == []
    assert sorted(select_generations(samples, 50)) == samples   # n past the set: all of it


def test_logger_writes_generations_and_drops_them_after_a_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    lg = MetricsLogger(["console", "tensorboard", "file"], str(tmp_path), stream=io.StringIO())
    for step in (2, 4):
        lg.log_generations(step, [("a `q`", f"out {step}", 0.5), ("b", "x", 1.0)])
    lg.close()
    lines = [json.loads(x) for x in (tmp_path / "val_generations.jsonl").read_text().splitlines()]
    assert lines[:2] == [{"step": 2, "input": "a `q`", "output": "out 2", "score": 0.5},
                         {"step": 2, "input": "b", "output": "x", "score": 1.0}] and len(lines) == 4
    ea = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    ea.Reload()
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in ea.Tensors("val/generations/text_summary")]
    assert [t[0] for t in texts] == [2, 4] and "``out 4``" in texts[1][1] and "``a 'q'``" in texts[0][1]
    resumed = MetricsLogger(["file"], str(tmp_path), stream=io.StringIO())
    resumed.truncate_after(3)
    resumed.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "val_generations.jsonl").read_text().splitlines()] == [2, 2]
    quiet = MetricsLogger(["file"], str(tmp_path / "other"), rank=1)
    quiet.log_generations(1, [("a", "b", 0.0)])
    assert not (tmp_path / "other").exists()


def test_mfu_figures():
    from megappo.metrics import mfu, peak_flops

    # names as torch.cuda.get_device_name() returns them -> dense bf16 TFLOPS (datasheets, no sparsity)
    expected = {
        "NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H100 PCIe": 756.5, "NVIDIA H100 NVL": 835,
        "NVIDIA H200": 989, "NVIDIA H200 NVL": 835, "NVIDIA GH200 480GB": 989,
        "NVIDIA H800": 989.4, "NVIDIA H800 PCIe": 756.5, "NVIDIA H20": 148,
        "NVIDIA A100-SXM4-80GB": 312, "NVIDIA A100 80GB PCIe": 312, "NVIDIA A800-SXM4-80GB": 312,
        "NVIDIA L40S": 362, "NVIDIA L40": 181, "NVIDIA L4": 121, "NVIDIA A10G": 70,
        "NVIDIA B200": 2250, "NVIDIA GB200": 2500,
    }
    assert {name: peak_flops(name) for name in expected} == {name: t * 1e12 for name, t in expected.items()}
    assert peak_flops("Some CPU") is None and peak_flops("NVIDIA H10") is None
    # 8B params, 1M tokens in 100 s on 8 H100s: 6*8e9*1e6 / (100*8*989e12) = 6.07%
    assert mfu(8_000_000_000, 1e6, 100.0, 8, 989e12) == pytest.approx(0.0606673, rel=1e-5)


def test_critic_diagnostics_against_numpy():
    """Value/return scale, advantage-return correlation and per-position mean advantages equal a
    numpy computation over the response tokens (masked tokens excluded)."""
    import numpy as np

    from megappo.batch import RolloutBatch
    from megappo.metrics import critic_diagnostics, data_metrics

    g = torch.Generator().manual_seed(4)
    B, T = 6, 7
    lengths = torch.tensor([7, 1, 3, 5, 2, 6])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    b = RolloutBatch.from_prompts_and_responses([[3, 4]] * B, torch.randint(3, 50, (B, T), generator=g), mask, 0)
    b.values = torch.randn(B, T, generator=g) * 3
    b.returns = torch.randn(B, T, generator=g) * 0.1
    b.advantages = b.returns - b.values + 0.05 * torch.randn(B, T, generator=g)
    got = critic_diagnostics(b, max_response_length=T)
    keep = mask.numpy().astype(bool)
    a, r, v = (x.numpy()[keep].astype(np.float64) for x in (b.advantages, b.returns, b.values))
    assert got["critic/values/std"] == pytest.approx(v.std(), rel=1e-9)
    assert got["critic/returns/std"] == pytest.approx(r.std(), rel=1e-9)
    assert got["critic/advantages_returns_corr"] == pytest.approx(np.corrcoef(a, r)[0, 1], rel=1e-9)
    adv = b.advantages.numpy().astype(np.float64)
    buckets = {"pos_0": [0], "pos_1": [1], "pos_2-3": [2, 3], "pos_4-6": [4, 5, 6]}
    assert sorted(k.split("/")[-1] for k in got if "/pos_" in k) == sorted(buckets)
    for name, ps in buckets.items():
        want = np.mean([adv[i, p] for i in range(B) for p in ps if p < lengths[i]])
        assert got[f"critic/advantages/{name}"] == pytest.approx(want, rel=1e-9), name
    # a random-scale critic (values std 3 vs returns 0.1) drowns the advantage: |corr| is small
    assert got["critic/values/std"] > 10 * got["critic/returns/std"]
    assert abs(got["critic/advantages_returns_corr"]) < 0.3
    assert set(got) <= set(data_metrics(b, max_response_length=T))  # part of the batch metrics
