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


def test_gan_covers_the_ring_with_two_optimizers_and_draws_its_samples(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)  # the settings' workspace is relative: runs/gan
    settings = json.loads((ROOT / "examples" / "gan" / "settings.json").read_text())
    (tmp_path / "short.json").write_text(json.dumps({**settings, "max_steps": 400}))  # the example's run, shorter
    gan = load(ROOT / "examples" / "gan" / "train.py")
    covered = gan.main(["short.json"])
    assert covered >= 6
    workspace = tmp_path / "runs/gan"
    rows = [json.loads(line) for line in (workspace / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [250, 400]
    assert {"loss/discriminator", "loss/generator", "lr/discriminator", "lr/generator"} <= rows[-1].keys()
    assert (workspace / "samples.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (workspace / "checkpoints").iterdir()) == ["400", "latest"]
    assert gan.main(["short.json"]) == covered  # resumed at step 400: the same generator
