"""The ``trainloop`` command line, run as users run it: subprocesses, real files, real signals.

Each subprocess pays the torch import (a few seconds), so a handful of them cover each
command's success and failure as a user sees them (exit code, stdout, stderr, files written);
the many variants of one error are run in-process through ``main()``, the same code path.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from cli_process import Cli, assert_one_clean_error, call, cli_env, console_script

from trainloop import TrainerSettings
from trainloop.cli import main
from trainloop.machine import State, draw
from trainloop.machine.trace import TraceEntry, summarize_trace

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests" / "support"  # where cli_trainers is
SCHEMA_FILE = REPO / "schemas" / "trainer_settings.schema.json"
TRAINER = "cli_trainers:CliTrainer"


pytestmark = pytest.mark.usefixtures("isolated_cli")  # see tests/conftest.py


# -- one real run, shared by the run, graph and inspect tests ----------------------------------

RUN_SETTINGS = """\
# max_steps is overridden by --set, seed by the environment
max_steps: 100
workspace: ws
trace: true
max_non_finite_grad_retries: 1
nan_at_steps: [2]
optimizer: {name: AdamW, lr: 0.01}
lr_schedule: {name: cosine, warmup_steps: 1}
hooks:
  - {type: checkpointing, interval: 3, keep_previous: 1}
"""


BAD_SETTINGS = "max_steps: 0\nworkspace: ws\nbogus: 1\nhooks:\n  - {type: checkpointing, interval: -1}\n"


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Cli, Path]]:
    """The subprocesses that need no other's result, started at once; each in its own directory."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in ("run", "invalid", "validate", "schema", "nodot")}
    (dirs["run"] / "run.yaml").write_text(RUN_SETTINGS)
    (dirs["invalid"] / "bad.yaml").write_text(BAD_SETTINGS)
    (dirs["validate"] / "run.yaml").write_text(RUN_SETTINGS)
    (dirs["nodot"] / "bin").mkdir()
    return {
        "run": (Cli(
            "run", "run.yaml", "--trainer", TRAINER, "--set", "max_steps=6",
            cwd=dirs["run"], env=cli_env(TRAINLOOP_SEED="3"),
        ), dirs["run"]),
        "invalid": (Cli("run", "bad.yaml", "--trainer", TRAINER, cwd=dirs["invalid"]), dirs["invalid"]),
        "validate": (Cli(
            "validate", "run.yaml", "--trainer", TRAINER, "--set", "seed=2", "--set", "hooks.0.interval=5",
            cwd=dirs["validate"], env=cli_env(
                TRAINLOOP_SEED="1", TRAINLOOP_MAX_STEPS="9", TRAINLOOP_LR="0.5",
                # Nested: a field of the optimizer, of the schedule, of a hook named by its type.
                TRAINLOOP_OPTIMIZER__LR="0.02", trainloop_lr_schedule__warmup_steps="2",
                TRAINLOOP_HOOKS__CHECKPOINTING__KEEP_PREVIOUS="3",
            ),
        ), dirs["validate"]),
        "schema": (Cli("schema", cwd=dirs["schema"], script=True), dirs["schema"]),
        "nodot": (Cli(
            "graph", "--format", "png", "--output", "m.png", cwd=dirs["nodot"], env=cli_env(PATH=str(dirs["nodot"] / "bin")),
        ), dirs["nodot"]),
    }


@pytest.fixture(scope="module")
def trained(launched) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """``trainloop run`` of 6 steps whose step 2 is retried once; checkpoints at steps 3 and 6."""
    process, root = launched["run"]
    return root / "ws", process.result()


@pytest.fixture(scope="module")
def after_run(trained) -> dict[str, Cli]:
    """The subprocesses that read the run's workspace, started at once."""
    workspace, result = trained
    assert result.returncode == 0, result.stderr
    return {
        "graph": Cli("graph", "--trace", workspace, cwd=workspace.parent),
        "inspect": Cli("inspect", workspace / "checkpoints", cwd=workspace.parent),
    }


def test_run_trains_from_a_settings_file_with_env_and_set_overrides(trained):
    workspace, result = trained
    assert result.returncode == 0, result.stderr
    saved = json.loads((workspace / "settings.json").read_text())
    assert saved["max_steps"] == 6
    assert saved["seed"] == 3  # --set and TRAINLOOP_SEED took effect
    assert saved["nan_at_steps"] == [2]  # validated with the trainer's own settings_class
    assert sorted(p.name for p in (workspace / "checkpoints").iterdir()) == ["3", "6", "latest"]
    assert (workspace / "trace.jsonl").stat().st_size > 0
    # Logging was configured (INFO, stderr) because the trainer's module did not configure it.
    assert "Saved checkpoint" in result.stderr
    assert "retrying (1/1)" in result.stderr
    assert "Traceback" not in result.stderr


def test_graph_with_a_trace_labels_edges_with_their_counts(after_run):
    result = after_run["graph"].result()
    assert result.returncode == 0, result.stderr
    mermaid = result.stdout
    assert mermaid.startswith("stateDiagram-v2\n")
    assert "    stepping --> retrying: retry [grads_non_finite] (n=1)\n" in mermaid
    assert "    stepping --> checkpointing: checkpoint [checkpoint_due] (n=2)\n" in mermaid
    assert "    stepping --> accumulating: begin_step / begin_step() (n=4)\n" in mermaid  # 6 steps - the first - the one after a save
    assert "    accumulating --> stepping: update (n=7)\n" in mermaid  # 6 steps and a retry
    assert "    retrying --> accumulating: redo_step / redo_step() (n=1)\n" in mermaid
    assert "    building --> exiting: fail (n=0)\n" in mermaid
    # The per-state time summary goes to stderr.
    summary = result.stderr
    assert "trace.jsonl: 6 steps, " in summary
    assert "retries: 1, checkpoints: 2" in summary
    states = [line.split()[0] for line in summary.splitlines()[1:]]
    assert {"building", "restoring", "stepping", "retrying", "checkpointing"} <= set(states)


def test_graph_dot_with_a_trace_weights_edges_in_process(trained, capsys):
    workspace, _ = trained
    code, dot, err = call(capsys, "graph", "--format", "dot", "--trace", workspace / "trace.jsonl")
    assert code == 0, err
    # Retries and saves stand out in colour; the width grows with the count.
    assert '"stepping" -> "retrying" [label="retry [grads_non_finite] (n=1)", penwidth=1.00, color=darkorange, fontcolor=darkorange];' in dot
    assert '"stepping" -> "checkpointing" [label="checkpoint [checkpoint_due] (n=2)", penwidth=1.45, color=royalblue, fontcolor=royalblue];' in dot
    assert '"stepping" -> "accumulating" [label="begin_step / begin_step() (n=4)", penwidth=1.90];' in dot
    # Edges this run never took are drawn faint and dashed.
    assert '"accumulating" -> "accumulating" [label="accumulate [microsteps_remain] (n=0)", color=gray70, fontcolor=gray55, style=dashed];' in dot
    assert "retries: 1, checkpoints: 2" in err


def test_inspect_the_latest_checkpoint_of_a_root(trained, after_run):
    workspace, _ = trained
    result = after_run["inspect"].result()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"checkpoint:   {(workspace / 'checkpoints' / '6').resolve()}  (latest of " in out
    assert "step:         6  (epoch 0)" in out
    assert "saved:        20" in out
    assert "(full format, trainloop " in out
    assert "files:        metadata.json (" in out
    assert "model.pt (" in out
    assert "matching its manifest" in out
    assert "model:        4 tensors, 49 elements, 196 B, float32" in out  # 4*8+8 + 8*1+1 floats
    assert "optimizer:    AdamW (from its param groups), 1 param group(s): name=default" in out
    assert "state for 4 params: 12 tensors" in out  # step, exp_avg, exp_avg_sq per parameter
    assert "lr scheduler: yes (last_epoch=6" in out
    assert "grad scaler:  disabled" in out
    assert "rng state:    saved for 1 rank(s): numpy, python, torch" in out
    assert "data loader:  position saved for 1 rank(s)" in out  # a plain DataLoader's sampler position
    assert '"nan_at_steps": [' in out
    assert '"seed": 3' in out  # the settings it was made with
    assert result.stderr == ""


def test_inspect_json_of_a_step_directory_and_of_a_workspace(trained, capsys):
    workspace, _ = trained
    code, out, err = call(capsys, "inspect", "--json", workspace / "checkpoints" / "3")
    assert code == 0, err
    info = json.loads(out)
    assert info["step"] == 3
    assert info["format"] == "full"
    assert info["metadata"]["step"] == 3
    assert sorted(info["files"]) == ["metadata.json", "model.pt", "training_state.pt"]
    assert info["model"] == {"tensors": 4, "elements": 49, "bytes": 196, "dtypes": ["float32"]}
    assert info["optimizer"]["class"] == "AdamW"
    assert info["optimizer"]["declared"] == "AdamW"
    assert info["settings"]["max_steps"] == 6
    assert info["hooks"] == {}
    code, out, _ = call(capsys, "inspect", "--json", workspace)  # a workspace: its checkpoints/latest
    assert code == 0
    assert json.loads(out)["step"] == 6


def _copy_checkpoints(trained, tmp_path: Path) -> Path:
    workspace, _ = trained
    root = tmp_path / "checkpoints"
    shutil.copytree(workspace / "checkpoints", root, symlinks=True)
    return root


def test_inspect_a_corrupt_latest_checkpoint_names_the_file_and_the_intact_one(trained, tmp_path, capsys):
    root = _copy_checkpoints(trained, tmp_path)
    model = root / "6" / "model.pt"
    model.write_bytes(model.read_bytes()[:100])  # a torn write
    code, out, err = call(capsys, "inspect", root)
    assert code == 1
    assert out == ""
    assert_one_clean_error(
        err, f"{model.resolve()}: cannot load: truncated or altered",
        f"the newest intact checkpoint under {root} is {root / '3'}",
    )
    code, _, err = call(capsys, "inspect", root / "6")
    assert code == 1
    assert_one_clean_error(err, f"{model}: cannot load: truncated or altered")
    assert "intact" not in err  # a directory given directly: no root to look in


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ("flipped-byte", "model.pt: cannot load: corrupt (its XXH3-128 checksum differs from its manifest's)"),
        ("no-training-state", "is not a complete checkpoint: missing training_state.pt"),
        ("no-manifest", "is not a complete checkpoint: it has no manifest.json"),
        ("not-a-state", "training_state.pt: not a trainloop training state (no 'step')"),
        ("empty", "no checkpoint here: no checkpoint files and no complete step directory"),
        ("leftover", "only an interrupted save's leftovers: .5.tmp-0a1b2c3d"),
        ("missing", "no such file or directory"),
    ],
)
def test_inspect_incomplete_checkpoints(trained, tmp_path, capsys, layout, message):
    target = _copy_checkpoints(trained, tmp_path) / "3"
    if layout == "flipped-byte":
        data = bytearray((target / "model.pt").read_bytes())
        data[-30] ^= 0xFF
        (target / "model.pt").write_bytes(bytes(data))
    elif layout == "no-training-state":
        (target / "training_state.pt").unlink()
    elif layout == "no-manifest":
        (target / "manifest.json").unlink()
    elif layout == "not-a-state":
        import torch

        from trainloop.checkpoint.manifest import write_manifest

        torch.save({"epoch": 1}, target / "training_state.pt")
        write_manifest(target)  # a consistent checkpoint, of the wrong contents
    elif layout == "empty":
        target = tmp_path / "empty"
        target.mkdir()
    elif layout == "leftover":
        target = tmp_path / "leftover"
        (target / ".5.tmp-0a1b2c3d").mkdir(parents=True)
    else:
        target = tmp_path / "absent"
    code, out, err = call(capsys, "inspect", target)
    assert code == 1
    assert out == ""
    assert_one_clean_error(err, message)


# -- a real SIGTERM during `trainloop run` -------------------------------------------------------


def test_sigterm_during_run_saves_and_exits_143(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({
        "max_steps": 100_000,
        "workspace": "ws",
        "step_sleep": 0.02,
        "report": True,
        "hooks": [{"type": "checkpointing", "interval": 1_000_000, "exit_signals": ["SIGTERM"]}],
    }))
    process = subprocess.Popen(
        [console_script(), "run", "run.json", "--trainer", TRAINER],
        cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if line == "step 2\n":
                break
        else:
            pytest.fail(f"the run ended before step 2: {process.stderr.read() if process.stderr else ''}")
        process.send_signal(signal.SIGTERM)
        rest, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 128 + signal.SIGTERM == 143, err
    # The step during which the signal landed finished, was saved, and was the last.
    last_step = int((["step 2"] + rest.splitlines())[-1].split()[1])
    assert [p.name for p in (tmp_path / "ws" / "checkpoints").iterdir() if p.name.isdigit()] == [str(last_step)]
    assert "Caught SIGTERM" in err
    assert "Traceback" not in err


# -- settings and trainer errors: exit 2, one clear message, nothing written -------------------


def test_run_with_invalid_settings_names_file_and_fields_and_writes_nothing(launched):
    process, root = launched["invalid"]
    result = process.result()
    assert result.returncode == 2
    assert_one_clean_error(
        result.stderr,
        "trainloop run: error: bad.yaml: max_steps: Input should be greater than 0 (got 0)\n",
        "trainloop run: error: bad.yaml: hooks[0].interval: Input should be greater than 0 (got -1)\n",
        "trainloop run: error: bad.yaml: bogus: unknown setting 'bogus'; valid here: max_steps, ",
    )
    assert result.stderr.count("\n") == 3  # one line per problem
    assert result.stdout == ""
    assert [p.name for p in root.iterdir()] == ["bad.yaml"]  # no workspace, nothing written


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("cli_trainers.CliTrainer", "expected module:Class"),
        ("cli_trainers:", "expected module:Class"),
        ("no_such_module_xyz:Trainer", "no module named 'no_such_module_xyz'"),
        ("cli_trainers:NoSuchTrainer", "'cli_trainers' has no attribute 'NoSuchTrainer'"),
        ("cli_trainers:CliSettings", "CliSettings is not a subclass of trainloop.BaseTrainer"),
        ("cli_trainers:time", "time is not a subclass of trainloop.BaseTrainer"),
        ("trainloop:BaseTrainer", "name your BaseTrainer subclass, not BaseTrainer itself"),
        ("broken_trainer:Trainer", "importing 'broken_trainer' failed: RuntimeError: no GPU here"),
        ("needs_dep:Trainer", "importing 'needs_dep' failed: No module named 'missing_dependency_xyz'"),
        ("syntax_error:Trainer", "importing 'syntax_error' failed: SyntaxError"),
    ],
)
def test_a_trainer_that_cannot_be_used_is_one_line_exit_2(tmp_path, capsys, monkeypatch, spec, message):
    (tmp_path / "broken_trainer.py").write_text("raise RuntimeError('no GPU here')\n")
    (tmp_path / "needs_dep.py").write_text("import missing_dependency_xyz\n")
    (tmp_path / "syntax_error.py").write_text("class Trainer(:\n")
    (tmp_path / "run.json").write_text('{"max_steps": 2, "workspace": "ws"}')
    monkeypatch.syspath_prepend(str(TESTS))
    for command in (["run", "run.json"], ["validate", "run.json"], ["schema", "--output", "schema.json"]):
        code, out, err = call(capsys, *command, "--trainer", spec)
        assert code == 2
        assert out == ""
        assert_one_clean_error(err, message)
        assert err.count("\n") == 1  # one line
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("__")) == [
        "broken_trainer.py", "needs_dep.py", "run.json", "syntax_error.py",
    ]


def test_the_working_directory_is_importable_for_trainer(tmp_path, capsys):
    (tmp_path / "my_train.py").write_text(
        "from trainloop import BaseTrainer, TrainerSettings\n"
        "class MySettings(TrainerSettings):\n    width: int = 3\n"
        "class MyTrainer(BaseTrainer):\n    settings_class = MySettings\n"
        "    def build_data_loader(self): ...\n    def build_model(self): ...\n"
        "    def build_optimizer(self): ...\n    def forward(self, batch): ...\n"
    )
    (tmp_path / "run.json").write_text('{"max_steps": 2, "width": 5}')
    code, out, err = call(capsys, "validate", "run.json", "--trainer", "my_train:MyTrainer")
    assert code == 0, err
    assert json.loads(out)["width"] == 5


BAD_FILES = [
    ("run.json", '{"max_steps": 3,', "run.json: malformed JSON: Expecting property name"),
    ("run.yaml", "max_steps: [1\n", "run.yaml: malformed YAML:"),
    ("run.toml", "max_steps = \n", "run.toml: malformed TOML:"),
    ("run.ini", "max_steps=3\n", "run.ini: unknown settings file type '.ini'"),
    ("run.json", "[1, 2]", "run.json: expected a mapping of settings, got list"),
    ("run.json", '{"max_steps": "10"}', "max_steps: Input should be a valid integer (got '10')"),
    ("run.json", '{"max_steps": 10, "trace": "yes"}', "trace: Input should be a valid boolean (got 'yes')"),
    ("run.json", '{"max_steps": 10, "lr": 0.1}', "run.json: lr: unknown setting 'lr'; valid here: max_steps, "),
    ("run.json", '{"max_steps": -1}', "max_steps: Input should be greater than 0 (got -1)"),
    ("run.yaml", "max_steps: 10\ngradient_accumulation_steps: 0\n", "gradient_accumulation_steps: Input should be greater than 0 (got 0)"),
    ("run.yaml", "max_steps: 10\nhooks: [{type: nope}]\n", "run.yaml: hooks[0]: unknown hook type 'nope'; registered types: checkpointing, "),
    ("run.json", "{}", "give max_steps, max_epochs or both"),
    ("run.json", '{"max_epochs": 0}', "max_epochs: Input should be greater than 0 (got 0)"),
]


@pytest.mark.parametrize(("name", "text", "message"), BAD_FILES)
def test_validate_reports_bad_files_naming_file_and_field(tmp_path, capsys, name, text, message):
    (tmp_path / name).write_text(text)
    code, out, err = call(capsys, "validate", name)
    assert code == 2
    assert out == ""
    assert_one_clean_error(err, name, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def test_validate_missing_file_and_bad_override(tmp_path, capsys):
    code, _, err = call(capsys, "validate", "absent.json")
    assert code == 2
    assert_one_clean_error(err, "absent.json: cannot read settings file: No such file or directory")
    (tmp_path / "run.json").write_text('{"max_steps": 3}')
    code, _, err = call(capsys, "validate", "run.json", "--set", "max_steps")
    assert code == 2
    assert_one_clean_error(err, "override 'max_steps': expected key=value")
    code, _, err = call(capsys, "validate", "run.json", "--set", "max_steps=0")
    assert code == 2
    assert_one_clean_error(err, "error: --set max_steps=0: max_steps: Input should be greater than 0 (got 0)")


def test_validate_prints_resolved_settings_file_then_env_then_set(launched):
    process, root = launched["validate"]
    result = process.result()
    assert result.returncode == 0, result.stderr
    settings = json.loads(result.stdout)
    assert settings["max_steps"] == 9
    assert settings["lr"] == 0.5  # env over the file
    assert settings["seed"] == 2  # --set over env
    assert settings["hooks"][0]["interval"] == 5
    assert settings["hooks"][0]["keep_previous"] == 3
    assert settings["optimizer"] == {**settings["optimizer"], "name": "AdamW", "lr": 0.02}
    assert settings["lr_schedule"]["warmup_steps"] == 2
    assert settings["nan_at_steps"] == [2]  # the trainer's own field
    assert [p.name for p in root.iterdir()] == ["run.yaml"]  # no workspace, nothing written


def test_usage_errors_exit_2(capsys):
    for argv in ([], ["graph", "--format", "gif"], ["nope"]):
        with pytest.raises(SystemExit) as exit:
            main(argv)
        assert exit.value.code == 2
        assert "usage: trainloop" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["validate", ""], "trainloop validate: error: argument SETTINGS_FILE: an empty path"),
        (["report", " "], "trainloop report: error: argument WORKSPACE: an empty path"),
        (["inspect", ""], "trainloop inspect: error: argument CHECKPOINT_DIR: an empty path"),
        (["export", "ws", "--output", ""], "trainloop export: error: argument --output/-o: an empty path"),
    ],
)
def test_an_empty_path_argument_is_named_not_read_as_the_current_directory(capsys, tmp_path, monkeypatch, argv, line):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == line
    assert list(tmp_path.iterdir()) == []


# -- schema ------------------------------------------------------------------------------------


def test_schema_is_the_committed_schema_file(launched):
    result = launched["schema"][0].result()
    assert result.returncode == 0, result.stderr
    assert result.stdout == SCHEMA_FILE.read_text()


def test_schema_output_and_a_trainer_schema(tmp_path, capsys, monkeypatch):
    code, printed, _ = call(capsys, "schema")
    assert code == 0
    assert printed == json.dumps(TrainerSettings.json_schema(), indent=2) + "\n"
    code, out, _ = call(capsys, "schema", "--output", tmp_path / "schema.json")
    assert code == 0
    assert out == ""
    assert (tmp_path / "schema.json").read_text() == printed
    monkeypatch.syspath_prepend(str(TESTS))
    code, out, _ = call(capsys, "schema", "--trainer", TRAINER)
    assert code == 0
    properties = json.loads(out)["properties"]
    assert "nan_at_steps" in properties
    assert "max_steps" in properties
    assert "$schema" in properties
    code, out, err = call(capsys, "schema", "--output", tmp_path / "no" / "such" / "dir.json")
    assert code == 1
    assert out == ""
    assert_one_clean_error(err, "dir.json: cannot write")


# -- graph -------------------------------------------------------------------------------------


def test_graph_without_trace_is_the_table(capsys, tmp_path):
    code, out, err = call(capsys, "graph")
    assert code == 0
    assert err == ""
    assert out == draw(format="mermaid")
    code, out, _ = call(capsys, "graph", "--format", "dot", "--output", tmp_path / "m.dot")
    assert code == 0
    assert out == ""
    assert (tmp_path / "m.dot").read_text() == draw(format="dot")


def test_graph_trace_errors(tmp_path, capsys):
    code, out, err = call(capsys, "graph", "--trace", tmp_path)
    assert code == 1
    assert out == ""
    assert_one_clean_error(err, f"{tmp_path / 'trace.jsonl'}: no trace file", '"trace": true')
    (tmp_path / "trace.jsonl").write_text('{"time": 1, "step": 0, "source": "idle", "dest": "building", "trigger": "start"}\n{"time": 2}\n')
    code, out, err = call(capsys, "graph", "--trace", tmp_path, "--output", tmp_path / "g.mmd")
    assert code == 1
    assert out == ""
    assert_one_clean_error(err, "trace.jsonl:2: not a trace entry")
    assert not (tmp_path / "g.mmd").exists()


def test_draw_with_counts():
    counts = Counter({(State.ACCUMULATING, State.STEPPING, "update"): 1000, (State.STEPPING, State.EXITING, "fail"): 1})
    dot = draw(format="dot", counts=counts)
    assert '"accumulating" -> "stepping" [label="update (n=1000)", penwidth=5.50];' in dot
    assert '"stepping" -> "exiting" [label="fail (n=1)", style=dashed, penwidth=1.00, color=red, fontcolor=red];' in dot
    assert '"idle" -> "building" [label="start (n=0)", color=gray70, fontcolor=gray55, style=dashed];' in dot
    mermaid = draw(format="mermaid", counts=counts)
    assert "    accumulating --> stepping: update (n=1000)\n" in mermaid
    assert draw(format="mermaid", counts=None) == draw(format="mermaid")  # unchanged without counts


def test_a_resumed_runs_trace_does_not_count_the_gap_between_runs():
    def run(start: float) -> list[TraceEntry]:
        states = [State.IDLE, State.BUILDING, State.RESTORING, State.ACCUMULATING, State.STEPPING, State.EXITING]
        triggers = ["start", "restore", "begin_step", "update", "finish"]
        return [TraceEntry(start + i, 1, a, b, t) for i, (a, b, t) in enumerate(zip(states, states[1:], triggers))]

    summary = summarize_trace(run(0.0) + run(1000.0))  # the second run began 1000 s later
    assert summary.runs == 2
    assert summary.seconds_in_state == {State.BUILDING: 2.0, State.RESTORING: 2.0, State.ACCUMULATING: 2.0, State.STEPPING: 2.0}
    assert summary.counts[(State.IDLE, State.BUILDING, "start")] == 2


def test_graph_svg_weighted_by_a_trace(trained, tmp_path, capsys):
    workspace, _ = trained
    output = tmp_path / "machine.svg"
    code, out, err = call(capsys, "graph", "--format", "svg", "--trace", workspace, "--output", output)
    assert code == 0, err
    svg = output.read_text()
    assert "<svg" in svg
    assert "retry [grads_non_finite] (n=1)" in svg
    assert out == ""


def test_graph_png_without_graphviz_says_how_to_get_it_and_svg_needs_none(launched):
    process, root = launched["nodot"]  # its PATH is an empty directory
    result = process.result()
    assert result.returncode == 1
    assert_one_clean_error(
        result.stderr, "needs Graphviz's `dot` program, which is not on PATH",
        "apt-get install graphviz", "conda install graphviz", "--format mermaid",
    )
    assert not (root / "m.png").exists()
    env = cli_env(PATH=str(root / "bin"))
    drawn = Cli("graph", "--format", "svg", "--output", "m.svg", cwd=root, env=env).result()
    assert drawn.returncode == 0, drawn.stderr
    assert 'data-state="validating"' in (root / "m.svg").read_text()


def test_a_settings_file_that_is_not_utf8_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "run.yaml").write_bytes("max_steps: 3\nworkspace: caf\u00e9\n".encode("cp1252"))
    for command in ("validate", "run"):
        code, out, err = call(capsys, command, "run.yaml", "--trainer", TRAINER)
        assert code == 2
        assert out == ""
        assert err == f"trainloop {command}: error: run.yaml: not a UTF-8 text file (byte 0xe9 at offset 27); save it as UTF-8\n"
    assert [p.name for p in tmp_path.iterdir()] == ["run.yaml"]


@pytest.mark.parametrize("workspace", ["s3://bkt/ws", "memory://ws", "s3:/bkt/ws"])
def test_a_workspace_written_as_a_url_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, workspace):
    (tmp_path / "run.yaml").write_text(f"max_steps: 3\nworkspace: {workspace}\n")
    for command in ("validate", "run"):
        code, out, err = call(capsys, command, "run.yaml", "--trainer", TRAINER)
        assert code == 2
        assert out == ""
        assert_one_clean_error(err, "run.yaml: workspace: ", repr(workspace))
        assert err.count("\n") == 1, err
    assert [p.name for p in tmp_path.iterdir()] == ["run.yaml"]


def test_run_without_a_trainer_says_how_to_name_one(tmp_path, capsys):
    (tmp_path / "run.json").write_text('{"max_steps": 3, "lr": 0.1}')  # lr: the trainer's own field
    code, out, err = call(capsys, "run", "run.json")
    assert code == 2
    assert out == ""
    assert err == 'trainloop run: error: run.json: no trainer to run: give --trainer MODULE:CLASS or a "trainer" key in the settings\n'
    (tmp_path / "run.json").write_text('{"max_steps": 3, "trainer": 5}')
    code, _, err = call(capsys, "run", "run.json")
    assert code == 2
    assert err == "trainloop run: error: run.json: trainer: Input should be a valid string (got 5)\n"


def test_a_warning_is_one_line_naming_the_command_not_a_line_of_trainloops_source(tmp_path, capsys):
    (tmp_path / "run.yaml").write_text("max_steps: 2\nworkspace: ws\nhooks:\n  - {type: checkpointing, interval: 2}\n")
    # The run to resume, in this process through main() (the same command; a subprocess costs ~6 s of
    # CPU); the resume whose warning this test reads is a real subprocess.
    code, _, err = call(capsys, "run", "run.yaml", "--trainer", "cli_trainers:CliTrainer")
    assert code == 0, err
    resumed = Cli("run", "run.yaml", "--trainer", "cli_trainers:CliTrainer", "--set", "max_steps=3", cwd=tmp_path).result()
    assert resumed.returncode == 0, resumed.stderr
    lines = resumed.stderr.splitlines()
    assert "trainloop run: warning: resuming with settings that differ from the checkpoint's: max_steps " \
           "(ChangedSettingsWarning)" in lines
    assert not [line for line in lines if "load_training_state(" in line or ".py:" in line]


HALF_HOOKS = """
import torch
from trainloop import BaseHook, BaseTrainer
from trainloop.hooks import Schedule


class NoAction(BaseHook):
    schedule = Schedule(every=2)


class Misspelt(BaseHook):
    def on_after_stpe(self, trainer):
        pass


class HalfHooks(BaseTrainer):
    def build_data_loader(self):
        return torch.utils.data.DataLoader(torch.randn(16, 4), batch_size=4)

    def build_model(self):
        return torch.nn.Linear(4, 1)

    def build_optimizer(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def forward(self, x):
        return self.model(x).pow(2).mean(), {}

    def build_hooks(self):
        return [NoAction(), Misspelt()]
"""


def test_hooks_built_by_build_hooks_that_cannot_act_are_one_line_each_exit_2_and_nothing_written(tmp_path):
    (tmp_path / "half_hooks.py").write_text(HALF_HOOKS)
    (tmp_path / "run.json").write_text('{"max_steps": 4, "workspace": "ws", "trainer": "half_hooks:HalfHooks"}')
    result = subprocess.run(
        [sys.executable, "-m", "trainloop", "run", "run.json"], cwd=tmp_path, env=cli_env(),
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert_one_clean_error(result.stderr)
    assert result.stderr.splitlines() == [
        "trainloop run: error: NoAction declares a schedule but no on_schedule() method to call when it is due",
        "trainloop run: error: Misspelt.on_after_stpe is not a hook method, so it would never be called; "
        "did you mean on_after_step?",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["half_hooks.py", "run.json"]  # no workspace
