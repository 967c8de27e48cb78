"""The examples run end to end, as the README says."""

import importlib.util
import json
import logging
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_digits_reaches_95_percent_and_resumes(tmp_path, monkeypatch, caplog):
    pytest.importorskip("sklearn")
    monkeypatch.chdir(tmp_path)  # the settings' workspace is relative: runs/digits
    digits = load(ROOT / "examples" / "digits" / "train.py")
    with caplog.at_level(logging.INFO, logger="trainloop"):
        accuracy = digits.main([])
    assert accuracy >= 0.95
    assert "Step 400/400" in caplog.text
    assert "Validation at step 100: val/loss" in caplog.text
    assert "Validation at step 400: val/loss" in caplog.text
    workspace = tmp_path / "runs/digits"
    best = json.loads((workspace / "checkpoints/best.json").read_text())["best"]
    kept = {"400", "latest", "best.json", str(best)}
    assert sorted(p.name for p in (workspace / "checkpoints").iterdir()) == sorted(kept)
    assert {"metrics.jsonl", "trace.jsonl", "runs.jsonl", "settings.json"} <= {p.name for p in workspace.iterdir()}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainloop"):
        assert digits.main([]) == accuracy  # resumed at step 400: nothing left to train
    assert "at step 400: the run is already complete (400 steps); nothing to train" in caplog.text
    assert "Step " not in caplog.text
