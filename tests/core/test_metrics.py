"""metrics.jsonl: every trainer.log call in the workspace, one line each, surviving resume."""

from __future__ import annotations

import json
import math

import pytest
from tiny_trainer import TinyTrainer

from trainloop import CheckpointingHook, LoggingHook, TrainerSettings
from trainloop.core.metrics import MetricsLog, read_metrics


class CrashAt(LoggingHook):
    def __init__(self, step: int) -> None:
        super().__init__(interval=1)
        self.crash_step = step

    def on_schedule(self, trainer):
        super().on_schedule(trainer)  # logs this step first
        if trainer.step == self.crash_step:
            raise KeyboardInterrupt  # as a user's Ctrl-C without exit signals would


def test_every_log_call_is_a_line_with_step_and_time(tmp_path):
    trainer = TinyTrainer(max_steps=4, hooks=[LoggingHook(interval=2)], workspace=tmp_path)
    trainer.train()
    trainer.log({"custom": {"a": 1, "text": "not a number"}, "nan": float("nan")})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    assert [r["step"] for r in rows] == [2, 4]  # the file closed with the run
    assert all(isinstance(r["time"], float) and isinstance(r["loss"], float) for r in rows)
    assert rows[0]["lr/group_0"] == 0.05
    assert "records/mse" in rows[0]
    assert trainer.metrics.history[-1]["custom/a"] == 1.0
    assert "custom/text" not in trainer.metrics.history[-1]
    assert read_metrics(tmp_path / "metrics.jsonl") == rows


def test_resume_drops_the_steps_after_the_checkpoint_so_none_is_duplicated(tmp_path):
    def hooks(crash: int | None):
        logging = CrashAt(crash) if crash else LoggingHook(interval=1)
        return [logging, CheckpointingHook(interval=3)]

    with pytest.raises(KeyboardInterrupt):
        TinyTrainer(max_steps=8, hooks=hooks(crash=5), workspace=tmp_path).train()
    first = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5]  # checkpoint at 3; 4 and 5 will be redone
    TinyTrainer(max_steps=8, hooks=hooks(crash=None), workspace=tmp_path).train()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert rows[:3] == first[:3]
    assert rows[3]["time"] > first[4]["time"]  # steps 4 and 5 as the resumed run logged them


def test_a_line_cut_off_by_a_killed_run_is_ignored_and_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "time": 1.0, "loss": null}\n{"step": 2, "ti')
    assert [r["step"] for r in read_metrics(path)] == [1]
    assert math.isnan(read_metrics(path)[0]["loss"])
    log = MetricsLog()
    log.open(path, resumed_step=1)
    log.record(2, {"loss": 0.5})
    log.close()
    assert [r["step"] for r in read_metrics(path)] == [1, 2]
    path.write_text('{"time": 1.0}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: not a metrics record"):
        read_metrics(path)


def test_turned_off_in_settings_from_the_environment(tmp_path):
    environment = {"TRAINLOOP_METRICS_FILE": "false", "TRAINLOOP_WORKSPACE": str(tmp_path)}
    settings = TrainerSettings.load(env=environment, overrides=["max_steps=2"])
    result = TinyTrainer(settings, hooks=[LoggingHook(interval=1)]).train()
    assert [row["step"] for row in result.history] == [1, 2]  # still kept in memory
    assert (tmp_path / "settings.json").exists()
    assert not (tmp_path / "metrics.jsonl").exists()
    assert TrainerSettings.load(env={"TRAINLOOP_MAX_STEPS": "2"}).metrics_file is True


def test_a_fresh_run_keeps_an_earlier_runs_records_beside_its_own(tmp_path, caplog):
    # No checkpoints: the second run starts fresh in the same workspace, and must not lose the first's records.
    TinyTrainer(max_steps=3, hooks=[LoggingHook(interval=1)], workspace=tmp_path).train()
    first = read_metrics(tmp_path / "metrics.jsonl")
    TinyTrainer(max_steps=2, hooks=[LoggingHook(interval=1)], workspace=tmp_path).train()
    assert read_metrics(tmp_path / "metrics.1.jsonl") == first
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    assert "kept as metrics.1.jsonl" in caplog.text
    TinyTrainer(max_steps=1, hooks=[LoggingHook(interval=1)], workspace=tmp_path).train()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.2.jsonl")] == [1, 2]  # the next free number
