"""``trainloop evaluate`` in a subprocess: the metrics as one JSON object on stdout; errors as one line, nothing written."""

from __future__ import annotations

import json

from cli_process import Cli, assert_one_clean_error
from eval_trainers import EvalSettings, EvalTrainer

TRAINER = ("--trainer", "eval_trainers:EvalTrainer")
HOOKS = [
    {"type": "validation", "evaluate": "val_metrics", "interval": 3},
    {"type": "checkpointing", "interval": 3, "keep_interval": 3},
    {"type": "ema", "decay": 0.5},
]


def write_settings(tmp_path, hooks=HOOKS):
    settings = {"max_steps": 6, "workspace": str(tmp_path / "ws"), "hooks": hooks}
    (tmp_path / "run.json").write_text(json.dumps(settings))
    return settings


def files(directory):
    return {str(p.relative_to(directory)): p.stat().st_mtime_ns for p in directory.rglob("*")} if directory.exists() else {}


def test_evaluate_prints_the_metrics_as_one_json_object(tmp_path):
    settings = write_settings(tmp_path)
    result = EvalTrainer(EvalSettings.model_validate(settings)).train()
    before = files(tmp_path / "ws" / "checkpoints")
    latest = Cli("evaluate", "run.json", *TRAINER, cwd=tmp_path)
    earlier = Cli("evaluate", "run.json", *TRAINER, "--checkpoint", "ws/checkpoints/3", cwd=tmp_path)
    ema = Cli("evaluate", "run.json", *TRAINER, "--weights", "ema", "--set", "max_steps=7", cwd=tmp_path)
    for run in (latest, earlier, ema):
        assert run.result().returncode == 0, run.result().stderr[-3000:]
    printed = json.loads(latest.result().stdout)
    assert printed == {"val/loss": result.metrics["val/loss"], "val/count": 25.0}
    assert latest.result().stdout.count("\n") == 1  # one line; the logs are on stderr
    assert "Validation at step 6: val/loss" in latest.result().stderr
    assert json.loads(earlier.result().stdout)["val/loss"] != printed["val/loss"]
    assert json.loads(ema.result().stdout)["val/loss"] != printed["val/loss"]
    assert files(tmp_path / "ws" / "checkpoints") == before
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "ws" / "runs.jsonl").read_text().splitlines()]
    assert kinds == ["train", "evaluate", "evaluate", "evaluate"]


def test_evaluate_errors_are_one_line_and_write_nothing(tmp_path):
    for name in ("novalidation", "missing", "nocheckpoint", "file"):
        (tmp_path / name).mkdir()
    write_settings(tmp_path / "novalidation", hooks=[{"type": "checkpointing", "interval": 3}])
    write_settings(tmp_path / "missing")
    write_settings(tmp_path / "nocheckpoint")
    write_settings(tmp_path / "file")
    (tmp_path / "file" / "model.pt").write_bytes(b"weights")
    runs = {
        "novalidation": Cli("evaluate", "run.json", *TRAINER, "--checkpoint", "none", cwd=tmp_path / "novalidation"),
        "missing": Cli("evaluate", "run.json", *TRAINER, "--checkpoint", "nowhere", cwd=tmp_path / "missing"),
        "nocheckpoint": Cli("evaluate", "run.json", *TRAINER, cwd=tmp_path / "nocheckpoint"),
        "file": Cli("evaluate", "run.json", *TRAINER, "--checkpoint", "model.pt", cwd=tmp_path / "file"),
    }
    expected = {
        "novalidation": (2, "nothing to evaluate: EvalTrainer has no ValidationHook"),
        "missing": (1, "checkpoint nowhere: no such directory"),
        "nocheckpoint": (1, "no complete checkpoint to load"),
        "file": (1, "checkpoint model.pt: a file, not a checkpoint directory (a directory a CheckpointingHook saved"),
    }
    for name, run in runs.items():
        result = run.result()
        code, needle = expected[name]
        assert result.returncode == code, (name, result.stderr[-3000:])
        assert result.stdout == ""
        errors = [line for line in result.stderr.splitlines() if line.startswith("trainloop evaluate: error:")]
        assert len(errors) == 1, (name, result.stderr[-3000:])
        assert needle in errors[0], (name, result.stderr[-3000:])
        assert "Traceback" not in result.stderr
        left = ["model.pt", "run.json"] if name == "file" else ["run.json"]
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == left, name  # nothing written


def test_evaluate_without_a_settings_file_is_a_usage_error(tmp_path):
    result = Cli("evaluate", "absent.json", *TRAINER, cwd=tmp_path).result()
    assert result.returncode == 2
    assert_one_clean_error(result.stderr, "absent.json")
