"""trainer.predict(): the run the machine makes of it, what it writes and returns, and its refusals.

One process here; two ranks under torchrun in tests/predict/test_predict_torchrun.py, the CLI in
tests/predict/test_predict_cli.py.
"""

from __future__ import annotations

import pytest
import torch
from predict_trainers import PredictTrainer
from safetensors import safe_open
from safetensors.torch import load_file
from tiny_trainer import make_data
from torch.utils.data import DataLoader

from trainloop import CheckpointingHook
from trainloop.core.preflight import PreflightError
from trainloop.core.result import read_runs
from trainloop.hooks.ema import EmaHook
from trainloop.machine import State
from trainloop.predict.order import PredictDataError, item_order
from trainloop.predict.outputs import PredictionError, PredictionOutputs


def trained(workspace, format="full", **kwargs):
    """Train 6 steps, saving every 3: checkpoints 3 and 6 (latest)."""
    trainer = PredictTrainer(max_steps=6, workspace=workspace, hooks=[CheckpointingHook(interval=3, format=format, keep_steps=[3])], **kwargs)
    trainer.train()
    return trainer


def expected(model_state, items=13):
    """What the model with ``model_state`` predicts for ``make_data(items, seed=1)``, in order."""
    model = PredictTrainer(max_steps=1).build_model()
    model.load_state_dict(model_state)
    with torch.no_grad():
        return model(make_data(items, seed=1).tensors[0])


def files(path):
    return sorted((p.relative_to(path), p.stat().st_mtime_ns) for p in path.rglob("*"))


def test_predict_latest_writes_every_item_once_in_order_and_records_the_run(tmp_path):
    ws = tmp_path / "ws"
    weights = {k: v.clone() for k, v in trained(ws, trace=True).unwrapped_model.state_dict().items()}
    checkpoints, metrics = files(ws / "checkpoints"), (ws / "metrics.jsonl").read_bytes()
    trainer = PredictTrainer(max_steps=6, workspace=ws, trace=True)
    outputs = trainer.predict()
    assert sorted(outputs) == ["x", "y"]
    torch.testing.assert_close(outputs["y"], expected(weights))
    torch.testing.assert_close(outputs["x"], make_data(13, seed=1).tensors[0])
    written = load_file(ws / "predictions.safetensors")
    assert written.keys() == outputs.keys()
    for name in outputs:
        assert torch.equal(written[name], outputs[name])
    with safe_open(str(ws / "predictions.safetensors"), framework="pt") as opened:
        metadata = opened.metadata()
    assert metadata["items"] == "13"
    assert metadata["step"] == "6"
    assert metadata["weights"] == "model"
    assert metadata["checkpoint"] == str(ws / "checkpoints" / "6")
    # The path through the machine, traced like any run.
    assert [(e.source, e.dest, e.trigger) for e in trainer.trace] == [
        (State.IDLE, State.BUILDING, "start"),
        (State.BUILDING, State.RESTORING, "restore"),
        (State.RESTORING, State.PREDICTING, "predict"),
        (State.PREDICTING, State.EXITING, "finish"),
    ]
    assert trainer.result.kind == "predict"
    assert trainer.result.exit_code == 0
    assert [run["kind"] for run in read_runs(ws)] == ["train", "predict"]
    # Nothing written into the checkpoints, metrics.jsonl kept.
    assert files(ws / "checkpoints") == checkpoints
    assert (ws / "metrics.jsonl").read_bytes() == metrics
    # Built for prediction only: no optimizer, no training data, no hooks.
    assert "optimizer" not in trainer.loop.run_state.built
    assert trainer.hooks == ()


@pytest.mark.parametrize("format", ["full", "sharded"])
def test_predict_from_a_given_checkpoint_directory_full_or_sharded_to_a_pt_file(tmp_path, format):
    ws = tmp_path / "ws"
    trained(ws, format)
    reference = PredictTrainer(max_steps=6)
    reference.predict(checkpoint=ws / "checkpoints" / "3", output=tmp_path / "ref.safetensors")
    out = tmp_path / "out" / "preds.pt"
    outputs = PredictTrainer(max_steps=6, workspace=ws, returns="tensor").predict(checkpoint=ws / "checkpoints" / "3", output=out)
    assert list(outputs) == ["predictions"]
    loaded = torch.load(out, weights_only=True)
    assert list(loaded) == ["predictions"]
    assert torch.equal(loaded["predictions"], outputs["predictions"])
    assert torch.equal(outputs["predictions"], load_file(tmp_path / "ref.safetensors")["y"])
    latest = PredictTrainer(max_steps=6, workspace=ws).predict(output=tmp_path / "latest.safetensors")
    assert not torch.equal(latest["y"], outputs["predictions"])  # step 6's weights differ from step 3's
    assert not (ws / "predictions.safetensors").exists()


def test_predict_with_ema_weights(tmp_path):
    ws = tmp_path / "ws"
    ema_hook = EmaHook(decay=0.5)
    PredictTrainer(max_steps=6, workspace=ws, hooks=[CheckpointingHook(interval=6), ema_hook]).train()
    ema_state = {k: v.clone() for k, v in ema_hook.ema_model.module.state_dict().items()}
    model = PredictTrainer(max_steps=6, workspace=ws).predict(output=tmp_path / "m.pt")
    ema = PredictTrainer(max_steps=6, workspace=ws).predict(weights="ema", output=tmp_path / "e.pt")
    torch.testing.assert_close(ema["y"], expected(ema_state))
    assert not torch.equal(ema["y"], model["y"])


def test_an_existing_file_is_replaced(tmp_path):
    out = tmp_path / "p.safetensors"
    out.write_text("old")
    PredictTrainer(max_steps=1).predict(checkpoint=None, output=out)
    assert load_file(out)["y"].shape == (13, 1)


@pytest.mark.parametrize(("returns", "what"), [("list", "returned a list"), ("none", "returned a NoneType")])
def test_a_predict_step_returning_something_else_fails_naming_the_batch_and_writes_nothing(tmp_path, returns, what):
    trainer = PredictTrainer(max_steps=1, workspace=tmp_path, returns=returns, wrong_at_batch=2)
    with pytest.raises(PredictionError, match=rf"PredictTrainer.predict_step\(\) {what} for batch 2: it must return a tensor"):
        trainer.predict(checkpoint=None)
    assert not (tmp_path / "predictions.safetensors").exists()
    assert trainer.state is State.EXITING
    assert trainer.result.exit_code == 1
    assert trainer.result.kind == "predict"


@pytest.mark.parametrize(
    ("returned", "problem"),
    [
        (torch.tensor(1.0), "returned a tensor of shape (), with no first dimension"),
        ({"a": torch.zeros(2), "b": torch.zeros(3)}, "first dimensions differ ('a': 2, 'b': 3)"),
        ({"a": 1.0}, "returned['a'] a float"),
        ({}, "returned an empty dict"),
        ({1: torch.zeros(2)}, "with the key 1, not a str"),
    ],
)
def test_outputs_refused(returned, problem):
    with pytest.raises(PredictionError, match=r"T.predict_step\(\) .* for batch 0") as caught:
        PredictionOutputs("T.predict_step()").add(returned)
    assert problem in str(caught.value)


def test_outputs_must_keep_their_names():
    outputs = PredictionOutputs("T.predict_step()")
    outputs.add({"a": torch.zeros(2, 3)})
    with pytest.raises(PredictionError, match=r"returned the names \['b'\], the first batch \['a'\] for batch 1"):
        outputs.add({"b": torch.zeros(2, 3)})


def test_a_trainer_without_predict_step_is_refused_before_anything_is_built(tmp_path):
    from tiny_trainer import TinyTrainer

    trainer = TinyTrainer(max_steps=1, workspace=tmp_path / "ws")
    with pytest.raises(PreflightError, match=r"TinyTrainer must implement build_predict_data_loader\(\)\nTinyTrainer must implement predict_step\(\)"):
        trainer.predict(checkpoint=None)
    assert trainer.state is State.IDLE
    assert not (tmp_path / "ws").exists()


@pytest.mark.parametrize("output", ["p.json", "", "."])
def test_a_bad_output_is_refused_before_anything_is_built(tmp_path, output):
    trainer = PredictTrainer(max_steps=1, workspace=tmp_path / "ws")
    with pytest.raises(ValueError, match="give a .safetensors or .pt file|give a file ending in"):
        trainer.predict(checkpoint=None, output=output)
    assert trainer.state is State.IDLE
    assert not (tmp_path / "ws").exists()


def test_a_shuffling_loader_in_one_process_is_written_in_the_order_it_yields():
    torch.manual_seed(3)
    trainer = PredictTrainer(max_steps=1, shuffle=True, seed=None)
    outputs = trainer.predict(checkpoint=None)
    x = make_data(13, seed=1).tensors[0]
    assert not torch.equal(outputs["x"], x)  # shuffled ...
    assert torch.equal(outputs["x"][outputs["x"][:, 0].argsort()], x[x[:, 0].argsort()])  # ... each item once


def test_item_order_refuses_what_cannot_give_every_item_once():
    data = make_data(10)
    with pytest.raises(PredictDataError, match="predict under 2 ranks needs a DataLoader with a DistributedSampler"):
        item_order(DataLoader(data, batch_size=4), rank=0, world_size=2)
    with pytest.raises(PredictDataError, match="drop_last=True: it leaves out the last 2 of its 10 items"):
        item_order(DataLoader(data, batch_size=4, drop_last=True), rank=0, world_size=1)
    order = item_order(DataLoader(data, batch_size=4), rank=0, world_size=1)
    assert order.length == 10
    assert torch.equal(order.indices, torch.arange(10))
    assert item_order(iter([1, 2]), rank=0, world_size=1) is None  # one process: the order yielded
