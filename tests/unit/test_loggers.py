"""wandb and mlflow sinks, offline (wandb's offline mode, mlflow's local file store): verl's
project/experiment naming, the config recorded, every step's scalars, and a resumed job writing
into the same run. Skipped when the optional package is not installed (pip install megappo[loggers])."""
import pytest

from megappo.metrics import MetricsLogger

CONFIG = {"data": {"train_batch_size": 8}, "trainer": {"project_name": "proj", "experiment_name": "exp"}}
STEPS = {1: {"critic/score/mean": 0.25, "val-core/synthetic/echo/reward/mean@1": 0.5, "note": "text"},
         2: {"critic/score/mean": 0.75}}


def _log(run_dir, sink, steps):
    lg = MetricsLogger([sink], str(run_dir), project="proj", experiment="exp", config=CONFIG)
    for step in steps:
        lg.log(step, STEPS[step])
    lg.close()


def test_wandb_offline(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    _log(tmp_path, "wandb", [1])
    _log(tmp_path, "wandb", [2])      # a resumed job: same run id
    run_id = (tmp_path / "wandb_run_id").read_text()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert runs and all(r.name.endswith(run_id) for r in runs), runs
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore

    history, config, names = {}, {}, set()
    for run in runs:
        ds = datastore.DataStore()
        ds.open_for_scan(str(next(run.glob("*.wandb"))))
        while (data := ds.scan_data()) is not None:
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
    assert '"train_batch_size": 8' in config["data"]
    assert float(history[1]["critic/score/mean"]) == 0.25 and float(history[2]["critic/score/mean"]) == 0.75
    assert float(history[1]["val-core/synthetic/echo/reward/mean@1"]) == 0.5 and "note" not in history[1]


def test_mlflow_local_store(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
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
