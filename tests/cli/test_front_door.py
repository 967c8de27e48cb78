"""The front door: ``--help`` without torch, a lazy package namespace, and a trainer module that
cannot be used as one (it exits, or parses trainloop's command line, at import) or is not named.

Every ``--help`` runs the real command in a subprocess under ``python -X importtime``, which lists
each module the process imported: the check is that torch is not among them (no timing here;
the times are in ``benchmarks/startup.py`` and docs/benchmarks.md).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from cli_process import Cli, cli_env

from trainloop.cli import COMMANDS

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "pydantic", "numpy", "transitions", "yaml")


def _imported(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``python -X importtime -m trainloop ARGS``; its result and the modules it imported."""
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "trainloop", *args],
        capture_output=True, text=True, env=cli_env(), timeout=120, check=False,
    )
    modules = {line.rsplit("|", 1)[1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")}
    return result, modules


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_answers_without_importing_torch(command):
    args = ["--help"] if command is None else [command, "--help"]
    result, modules = _imported(*args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"usage: trainloop{'' if command is None else ' ' + command}"), result.stdout
    assert "trainloop.cli" in modules  # the listing is real: it names what ran
    assert [m for m in HEAVY if m in modules] == []
    if command is not None:
        assert f"trainloop.cli.{command}" not in modules  # the command's module: only when it runs


def test_a_bad_argument_is_answered_without_torch_too():
    result, modules = _imported("graph", "--format", "gif")
    assert result.returncode == 2
    assert "invalid choice: 'gif'" in result.stderr
    assert "torch" not in modules


def test_the_package_namespace_imports_a_name_on_first_use():
    code = (
        "import sys\n"
        "import trainloop\n"
        "assert 'torch' not in sys.modules, 'import trainloop imported torch'\n"
        "assert set(trainloop.__all__) <= set(dir(trainloop))\n"
        "from trainloop import BaseTrainer, TrainerSettings\n"
        "assert 'torch' in sys.modules and BaseTrainer.__module__ == 'trainloop.trainer'\n"
        "assert 'torch.distributed.fsdp' not in sys.modules, 'the contract imported FSDP'\n"
        "from trainloop import *\n"
        "assert all(globals()[name] is getattr(trainloop, name) for name in trainloop.__all__)\n"
        "try:\n"
        "    trainloop.NoSuchName\n"
        "except AttributeError as error:\n"
        "    assert 'NoSuchName' in str(error)\n"
        "else:\n"
        "    raise AssertionError('no AttributeError')\n"
        "from trainloop.distributed import wrap_model, FSDPOptions\n"
        "assert 'torch.distributed.fsdp' in sys.modules\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=120, check=False)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]


# -- a trainer module that cannot be imported as one ---------------------------------------------

EXITS = """\
import sys
from trainloop import BaseTrainer

class T(BaseTrainer):
    pass

print("starting the script")
sys.exit(0)
"""

PARSES_ARGV = """\
import argparse
from trainloop import BaseTrainer

class T(BaseTrainer):
    pass

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()
"""

SETTINGS = '{"max_steps": 3, "workspace": "ws"}\n'


@pytest.mark.parametrize(("module", "said"), [("exits", "starting the script"), ("parses", "unrecognized arguments")])
def test_a_trainer_module_that_exits_at_import_is_one_line_exit_2(tmp_path, module, said):
    (tmp_path / "exits.py").write_text(EXITS)
    (tmp_path / "parses.py").write_text(PARSES_ARGV)
    (tmp_path / "settings.json").write_text(SETTINGS)
    (tmp_path / "named.json").write_text(f'{{"max_steps": 3, "workspace": "ws", "trainer": "{module}:T"}}\n')
    launched = [
        Cli("validate", "settings.json", "--trainer", f"{module}:T", cwd=tmp_path),
        Cli("run", "settings.json", "--trainer", f"{module}:T", cwd=tmp_path),
        Cli("run", "named.json", cwd=tmp_path),
        Cli("schema", "--trainer", f"{module}:T", cwd=tmp_path),
    ]
    for cli in launched:
        result = cli.result()
        command = result.args[3]
        assert result.returncode == 2, (result.args, result.stderr)
        assert result.stdout == ""  # not "validated" settings, not the module's own output
        lines = result.stderr.splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith(f"trainloop {command}: error: ")
        assert f"importing {module!r} exited" in lines[0]
        assert said in lines[0]
        assert '__name__ == "__main__"' in lines[0]
    assert not (tmp_path / "ws").exists()


def test_a_trainer_module_that_prints_at_import_still_speaks(tmp_path, capsys, monkeypatch):
    # Held while it imports, then released: a module's own output, and a logging handler it set
    # up at import, still reach the real streams.
    from trainloop.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [str(tmp_path), *sys.path])
    (tmp_path / "speaks.py").write_text(
        "import logging, sys\n"
        "from cli_trainers import CliTrainer\n"
        "print('hello from speaks')\n"
        "logging.getLogger('speaks').addHandler(logging.StreamHandler(sys.stderr))\n"
        "class T(CliTrainer):\n"
        "    pass\n"
    )
    (tmp_path / "settings.json").write_text('{"max_steps": 3}\n')
    assert main(["validate", "settings.json", "--trainer", "speaks:T"]) == 0
    import logging

    logging.getLogger("speaks").warning("after the import")
    out, err = capsys.readouterr()
    assert out.startswith("hello from speaks\n{")
    assert "after the import" in err


# -- unknown settings that a trainer's settings class knows ----------------------------------------


def test_validate_without_a_trainer_says_which_trainer_knows_the_unknown_settings():
    # The digits example as a new user first tries it: no --trainer, no "trainer" key.
    example = REPO / "examples" / "digits"
    result = Cli("validate", "settings.json", cwd=example).result()
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert [line for line in lines if "unknown setting" in line] == [
        f"trainloop validate: error: settings.json: {key}: unknown setting {key!r}; valid here: " + line.split("valid here: ", 1)[1]
        for key, line in zip(("hidden_dim", "batch_size"), [ln for ln in lines if "unknown setting" in ln], strict=True)
    ]
    hint = lines[-1]
    assert hint == (
        "trainloop validate: error: settings.json: 'hidden_dim', 'batch_size' are settings of train:DigitsTrainer: "
        "name the trainer with --trainer train:DigitsTrainer or a \"trainer\" key"
    )
    assert len(lines) == 3


def test_unknown_settings_no_trainer_in_sight_declares_get_the_general_hint(tmp_path, capsys, monkeypatch):
    from trainloop.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "settings.json").write_text('{"max_steps": 3, "lr": 0.1}\n')
    (tmp_path / "train.py").write_text(  # declares other fields: not named (read, never imported)
        "raise SystemExit('never imported')\n"
        "class S(TrainerSettings):\n    width: int = 3\n"
        "class T(BaseTrainer):\n    settings_class = S\n"
    )
    assert main(["validate", "settings.json"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines()[-1] == (
        "trainloop validate: error: settings.json: 'lr' is not a TrainerSettings field: if your trainer's "
        "settings_class declares it, name the trainer with --trainer MODULE:CLASS or a \"trainer\" key"
    )
    # A typo of a real field gets its "did you mean" and no trainer hint.
    (tmp_path / "settings.json").write_text('{"max_stpes": 3}\n')
    assert main(["validate", "settings.json"]) == 2
    assert "--trainer" not in capsys.readouterr().err


def test_a_trainer_s_own_settings_are_found_through_a_settings_base_in_the_module(tmp_path, capsys, monkeypatch):
    from trainloop.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "settings.yaml").write_text("max_steps: 3\nwidth: 4\ndepth: 2\n")
    (tmp_path / "model.py").write_text(
        "class Base(TrainerSettings):\n    width: int = 3\n"
        "class S(Base):\n    depth: int = 1\n"
        "class Net(BaseTrainer):\n    settings_class = S\n"
    )
    assert main(["validate", "settings.yaml"]) == 2
    assert "are settings of model:Net: name the trainer with --trainer model:Net" in capsys.readouterr().err.splitlines()[-1]
