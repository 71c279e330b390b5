"""wandb and mlflow sinks, offline (wandb's offline mode, mlflow's local file store): verl's
project/experiment naming, the config recorded, every step's scalars, and a resumed job writing
into the same run. Skipped when the optional package is not installed (pip install megappo[loggers])."""
import json

import pytest

from megappo.metrics import MetricsLogger

CONFIG = {"data": {"train_batch_size": 8}, "trainer": {"project_name": "proj", "experiment_name": "exp"}}
STEPS = {1: {"critic/score/mean": 0.25, "val-core/synthetic/echo/reward/mean@1": 0.5, "note": "text"},
         2: {"critic/score/mean": 0.75}}


GENERATIONS = [("what is 1+1?", "2", 1.0), ("say hi", "bye", 0.0)]   # logged at step 1


def _log(run_dir, sink, steps):
    lg = MetricsLogger([sink], str(run_dir), project="proj", experiment="exp", config=CONFIG)
    for step in steps:
        lg.log(step, STEPS[step])
        if step == 1:
            lg.log_generations(step, GENERATIONS)
    lg.close()


def _wandb_records(data: bytes) -> list[bytes]:
    """The records of an offline run file (wandb's transaction log: a 7-byte file header, then
    LevelDB's log format: 32 KiB blocks of records with a 7-byte header (crc, length, type:
    1 full, 2 first, 3 middle, 4 last). wandb 0.2x+ reads it in Go only, so read it here."""
    import struct

    assert data[:4] == b":W&B", data[:7]
    block, i, out, part = 32768, 7, [], b""
    while i + 7 <= len(data):
        left = block - i % block
        _, length, kind = struct.unpack("<IHB", data[i:i + 7])
        if left < 7 or (length == 0 and kind == 0):   # block trailer padding
            i += left
            continue
        payload, i = data[i + 7:i + 7 + length], i + 7 + length
        if kind == 1:
            out.append(payload)
        elif kind in (2, 3):
            part += payload
        elif kind == 4:
            out.append(part + payload)
            part = b""
    return out


def test_wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    try:
        _log(tmp_path, "wandb", [1])
        _log(tmp_path, "wandb", [2])      # a resumed job: same run id
    finally:
        wandb.teardown()   # ends wandb's service process, which would otherwise live as long as pytest
    run_id = (tmp_path / "wandb_run_id").read_text()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(f"-{run_id}" in r.name for r in runs), runs
    from wandb.proto import wandb_internal_pb2 as pb

    history, config, names = {}, {}, set()
    for run in runs:
        for data in _wandb_records(next(run.glob("*.wandb")).read_bytes()):
            rec = pb.Record()
            rec.ParseFromString(data)
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): i.value_json for i in rec.history.item}
                history[int(items["_step"])] = items
            elif kind == "run":
                names.add((rec.run.project, rec.run.display_name))
                config.update({i.key: i.value_json for i in rec.run.config.update})
    assert names == {("proj", "exp")}
    assert json.loads(config["data"]) == {"train_batch_size": 8}
    assert float(history[1]["critic/score/mean"]) == 0.25 and float(history[2]["critic/score/mean"]) == 0.75
    assert float(history[1]["val-core/synthetic/echo/reward/mean@1"]) == 0.5 and "note" not in history[1]
    # the validation samples: verl's table, a row per validation
    table = {k.split("/")[-1]: json.loads(v) for k, v in history[1].items() if k.startswith("val/generations/")}
    assert table["_type"] == "table-file" and table["ncols"] == 7
    data = json.loads(next(runs[0].glob("files/" + table["path"])).read_text())
    assert data["columns"] == ["step", "input_1", "output_1", "score_1", "input_2", "output_2", "score_2"]
    assert data["data"] == [[1, "what is 1+1?", "2", 1.0, "say hi", "bye", 0.0]]


def test_mlflow_local_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    _log(tmp_path, "mlflow", [1])
    _log(tmp_path, "mlflow", [2])     # a resumed job: same run
    client = mlflow.tracking.MlflowClient(tracking_uri="file://" + str(tmp_path / "mlruns"))
    exp = client.get_experiment_by_name("proj")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == "exp"
    run = runs[0]
    assert run.info.run_id == (tmp_path / "mlflow_run_id").read_text()
    assert run.data.params["data.train_batch_size"] == "8"
    score = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert [(m.step, m.value) for m in score] == [(1, 0.25), (2, 0.75)]
    val = client.get_metric_history(run.info.run_id, "val-core/synthetic/echo/reward/mean_at_1")
    assert [(m.step, m.value) for m in val] == [(1, 0.5)]
    saved = json.loads(open(client.download_artifacts(run.info.run_id, "val_generations/step_1.json",
                                                       str(tmp_path / "dl"))).read())
    assert saved == {"step": 1, "samples": [{"input": "what is 1+1?", "output": "2", "score": 1.0},
                                            {"input": "say hi", "output": "bye", "score": 0.0}]}
