"""``trainer.evaluate()``: building -> restoring -> validating -> exiting, on restored weights, writing nothing."""

from __future__ import annotations

import json
import os

import pytest
import torch
from eval_trainers import EvalTrainer

from trainloop.checkpoint.errors import CheckpointError
from trainloop.core.result import read_runs
from trainloop.core.run_kinds import EvaluateError
from trainloop.hooks.checkpointing import CheckpointingHook
from trainloop.hooks.ema import EmaHook
from trainloop.hooks.validation import ValidationHook
from trainloop.machine import State
from trainloop.trainer import BaseTrainer


def hooks(format="full", ema=False):
    made = [ValidationHook("val_metrics", interval=3), CheckpointingHook(interval=3, format=format, keep_interval=3)]
    return made + [EmaHook(decay=0.5)] if ema else made


def trained(tmp_path, **kwargs):
    trainer = EvalTrainer(max_steps=6, workspace=tmp_path / "ws", trace=True, hooks=hooks(**kwargs))
    return trainer, trainer.train()


def snapshot(directory):
    """Every file under ``directory`` with its size and mtime."""
    return {
        str(p.relative_to(directory)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(directory.rglob("*"))
    }


def test_evaluate_restores_the_latest_checkpoint_and_runs_every_validation_once(tmp_path):
    _, result = trained(tmp_path)
    workspace = tmp_path / "ws"
    before = snapshot(workspace / "checkpoints")
    metrics_file = (workspace / "metrics.jsonl").read_bytes()
    trace_file = (workspace / "trace.jsonl").read_bytes()

    evaluator = EvalTrainer(max_steps=6, workspace=workspace, trace=True, hooks=hooks())
    metrics = evaluator.evaluate()

    assert metrics == {"val/loss": result.metrics["val/loss"], "val/count": 25.0}  # the weights validated at 6
    assert [(e.source, e.dest) for e in evaluator.trace] == [
        (State.IDLE, State.BUILDING), (State.BUILDING, State.RESTORING),
        (State.RESTORING, State.VALIDATING), (State.VALIDATING, State.EXITING),
    ]
    assert (evaluator.result.kind, evaluator.result.step, evaluator.step) == ("evaluate", 6, 6)
    assert snapshot(workspace / "checkpoints") == before  # nothing written, nothing touched
    assert (workspace / "metrics.jsonl").read_bytes() == metrics_file
    assert (workspace / "trace.jsonl").read_bytes() == trace_file
    assert [run["kind"] for run in read_runs(workspace)] == ["train", "evaluate"]
    # A run that resumes afterwards is the training run's continuation: evaluating counted nothing.
    again = EvalTrainer(max_steps=9, workspace=workspace, hooks=hooks())
    assert again.train().step == 9


def test_evaluate_from_a_sharded_checkpoint_equals_the_full_one(tmp_path):
    _, full = trained(tmp_path / "full")
    _, sharded = trained(tmp_path / "sharded", format="sharded")
    assert full.metrics["val/loss"] == sharded.metrics["val/loss"]  # the same training
    directory = tmp_path / "sharded" / "ws" / "checkpoints" / "6"
    metrics = EvalTrainer(max_steps=6, hooks=hooks()).evaluate(directory)
    assert metrics["val/loss"] == full.metrics["val/loss"]
    earlier = EvalTrainer(max_steps=6, hooks=hooks()).evaluate(directory.parent / "3")
    assert earlier["val/loss"] != metrics["val/loss"]  # the directory given is the one evaluated


def test_evaluate_the_ema_weights(tmp_path):
    trainer, _ = trained(tmp_path, ema=True)
    ema = next(h for h in trainer.hooks if isinstance(h, EmaHook))
    with torch.no_grad():  # the expected value: the validation run on the averaged weights
        trainer.unwrapped_model.load_state_dict(ema.ema_model.module.state_dict())
        expected = trainer.val_metrics()["loss"]
    workspace = tmp_path / "ws"
    on_ema = EvalTrainer(max_steps=6, workspace=workspace, hooks=hooks(ema=True)).evaluate(weights="ema")
    on_model = EvalTrainer(max_steps=6, workspace=workspace, hooks=hooks(ema=True)).evaluate()
    assert on_ema["val/loss"] == pytest.approx(expected, rel=1e-6)
    assert on_ema["val/loss"] != on_model["val/loss"]


def test_without_a_checkpoint_latest_is_an_error_and_none_evaluates_the_model_as_built(tmp_path):
    workspace = tmp_path / "ws"
    with pytest.raises(CheckpointError, match=r"no complete checkpoint to load \(.*ws/checkpoints\)"):
        EvalTrainer(max_steps=6, workspace=workspace, hooks=hooks()).evaluate()
    assert not workspace.exists()  # nothing written
    as_built = EvalTrainer(max_steps=6, workspace=workspace, hooks=hooks()).evaluate(None)
    fresh = EvalTrainer(max_steps=6)
    fresh.model = fresh.build_model()
    assert as_built["val/loss"] == fresh.val_metrics()["loss"]


def test_a_missing_checkpoint_directory_and_no_validation_hook_are_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match=r"checkpoint .*nowhere: no such directory"):
        EvalTrainer(max_steps=6).evaluate(tmp_path / "nowhere")
    with pytest.raises(EvaluateError, match="nothing to evaluate: EvalTrainer has no ValidationHook"):
        EvalTrainer(max_steps=6, workspace=tmp_path / "ws", hooks=[CheckpointingHook(interval=3)]).evaluate(None)
    assert not (tmp_path / "ws" / "runs.jsonl").exists()  # refused, not run


def test_overriding_evaluate_is_an_error_when_the_class_is_defined():
    with pytest.raises(TypeError, match=r"Mine.evaluate overrides BaseTrainer.evaluate\(\).*rename your validation"):

        class Mine(BaseTrainer):
            def evaluate(self):
                return {}


def test_a_validation_method_named_evaluate_is_refused_before_training(tmp_path):
    from eval_trainers import EvalSettings

    from trainloop.core.preflight import PreflightError

    declared = EvalSettings(max_steps=2, hooks=[{"type": "validation", "evaluate": "evaluate", "interval": 1}])
    with pytest.raises(PreflightError, match=r"hooks\[0\].evaluate: EvalTrainer.evaluate\(\) is a run of the trainer"):
        EvalTrainer(declared).train()
    trainer = EvalTrainer(max_steps=2, hooks=[ValidationHook("evaluate", interval=1)])
    with pytest.raises(TypeError, match=r"trainer.evaluate\(\) is a run of the trainer"):
        trainer.train()
    assert trainer.step == 0  # before the first step


def test_runs_jsonl_lines_name_their_kind(tmp_path):
    trained(tmp_path)
    EvalTrainer(max_steps=6, workspace=tmp_path / "ws", hooks=hooks()).evaluate()
    lines = [json.loads(line) for line in (tmp_path / "ws" / "runs.jsonl").read_text().splitlines()]
    assert [(line["kind"], line["step"], line["exit_code"]) for line in lines] == [("train", 6, 0), ("evaluate", 6, 0)]
    assert os.path.getsize(tmp_path / "ws" / "runs.jsonl") > 0


def test_a_trainer_that_trained_does_not_evaluate_too(tmp_path):
    trainer, _ = trained(tmp_path)
    with pytest.raises(RuntimeError, match=r"evaluate\(\) runs once per trainer .*state 'exiting': make a new trainer"):
        trainer.evaluate()


def test_a_corrupt_latest_is_skipped_with_one_warning_and_the_fallback_verified_once(tmp_path, caplog, monkeypatch):
    # Issue 29: evaluate/predict logged the skip twice and hashed the fallback checkpoint three times.
    from predict_trainers import PredictTrainer

    import trainloop.checkpoint.manifest as manifest

    trained(tmp_path)  # checkpoints 3 and 6
    model = tmp_path / "ws" / "checkpoints" / "6" / "model.pt"
    damaged = bytearray(model.read_bytes())
    damaged[200] ^= 0xFF
    model.write_bytes(bytes(damaged))
    hashed: list[str] = []
    real = manifest.check_hashes

    def counting(directory, expected, files):
        hashed.append(os.path.basename(directory))
        return real(directory, expected, files)

    monkeypatch.setattr(manifest, "check_hashes", counting)
    for run in (
        lambda: EvalTrainer(max_steps=6, workspace=tmp_path / "ws", hooks=hooks()).evaluate(),
        lambda: PredictTrainer(max_steps=6, workspace=tmp_path / "ws", hooks=hooks()[1:]).predict(),
    ):
        caplog.clear()
        hashed.clear()
        with caplog.at_level("INFO", logger="trainloop"):
            run()
        skipped = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Skipping checkpoint")]
        assert len(skipped) == 1, skipped
        assert hashed == ["6", "3"]  # the corrupt one, then the fallback: once each
        assert any(r.getMessage().startswith("Loaded 4 model weights from") and r.getMessage().endswith("checkpoints/3 (step 3)") for r in caplog.records)
