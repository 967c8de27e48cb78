"""``trainloop report`` on workspace files that parse but are not what trainloop wrote (edited
by hand, written by another tool): never a traceback; what is wrong is left out and said on the
page, naming the file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_process import Cli, call
from tiny_trainer import TinyTrainer

from trainloop import CheckpointingHook, ValidationHook

pytestmark = pytest.mark.usefixtures("isolated_cli")  # see tests/conftest.py


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    """A run with metrics, a best checkpoint and a runs.jsonl; its metric names hold two ``$``."""
    root = tmp_path / "ws"
    validation = ValidationHook(lambda t: {"cost$^$ loss": 1.0 / t.step}, interval=2)
    TinyTrainer(max_steps=4, hooks=[validation, CheckpointingHook(interval=2, keep_best=1, monitor="val/cost$^$ loss")],
                workspace=root).train()
    return root


def _append(path: Path, line: str) -> int:
    """Append ``line``; its line number."""
    with path.open("a") as file:
        file.write(line + "\n")
    return len(path.read_text().splitlines())


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_wrong_values_in_every_file_are_notes_on_the_page_not_a_traceback(workspace, tmp_path):
    n = _append(workspace / "metrics.jsonl", '{"step": 5, "time": 1.0, "loss": "high", "val/acc": {"a": 1}}')
    _append(workspace / "runs.jsonl", '{"time": 1.0, "step": null, "epoch": 0, "exit_code": 0, "error": null}')
    _append(workspace / "runs.jsonl", '{"time": 1.0, "step": 3, "epoch": 0, "exit_code": "zero", "error": null}')
    _edit_json(workspace / "checkpoints" / "best.json", lambda d: d["scores"].update({"4": "low"}))
    result = Cli("report", "ws", "--output", "page.html", cwd=tmp_path).result()
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    page = (tmp_path / "page.html").read_text()
    assert f"metrics.jsonl:{n}: &#x27;loss&#x27; is not a number (&quot;high&quot;); left out" in page
    assert f"metrics.jsonl:{n}: &#x27;val/acc&#x27; is not a number" in page
    assert "runs.jsonl: run 2: step is null, not what trainloop writes; run left out" in page
    assert "runs.jsonl: run 3: exit_code is &quot;zero&quot;, not what trainloop writes; run left out" in page
    assert "best.json: the score of checkpoint 4 is &quot;low&quot;, not a number; left out" in page
    assert 'title="cost$^$ loss"' in page  # the family of val/cost$^$ loss...
    assert ">val/cost$^$ loss</text>" in page  # ...and the key, drawn as written, not as math


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"step": null, "loss": 1.0}', "not a metrics record"),
        ('{"step": "x", "loss": 1.0}', "not a metrics record"),
        ("[1, 2]", "not a metrics record"),
    ],
)
def test_a_line_that_is_not_a_record_is_one_line_naming_file_and_line(workspace, tmp_path, capsys, line, message):
    n = _append(workspace / "metrics.jsonl", line)
    code, out, err = call(capsys, "report", workspace)
    assert code == 1
    assert out == ""
    assert err.startswith("trainloop report: error: ")
    assert f"metrics.jsonl:{n}: {message}" in err
    assert err.count("\n") == 1
    assert not (workspace / "report.html").exists()


def test_settings_that_are_not_an_object_are_one_line(workspace, capsys):
    (workspace / "settings.json").write_text("[1]")
    code, _, err = call(capsys, "report", workspace)
    assert code == 1
    assert err.count("\n") == 1
    assert "settings.json: not the settings of a run" in err


def test_an_existing_but_empty_metrics_file_is_not_called_missing(tmp_path):
    from trainloop.report import build_report

    TinyTrainer(max_steps=2, workspace=tmp_path / "ws").train()
    (tmp_path / "ws" / "metrics.jsonl").write_text("")
    page = build_report(tmp_path / "ws")
    assert "No metrics.jsonl" not in page
    assert "metrics.jsonl holds no records: nothing was logged" in page
