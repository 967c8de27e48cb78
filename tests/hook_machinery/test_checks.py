"""Each hook owns its checks: the preflight asks each declared hook class (``check_settings``,
``check_together``), so a hook a user registers is checked by ``trainloop validate`` exactly as
``trainloop run`` checks it; and the preflight runs once per command."""

from __future__ import annotations

import json
import textwrap

import pytest
from cli_process import Cli, assert_one_clean_error, cli_env
from tiny_trainer import TinyTrainer

from trainloop import BaseHook, PreflightError, TrainerSettings, register_hook
from trainloop.hooks import unregister_hook

# A user's hook in a user's module, named by the settings file's trainer.
MY_HOOKS = textwrap.dedent(
    '''
    import sys

    from cli_trainers import CliTrainer
    from pydantic import validate_call

    from trainloop import BaseHook, register_hook


    @register_hook("marker")
    class MarkerHook(BaseHook):
        """Writes a file into the workspace at the end of the run."""

        @validate_call
        def __init__(self, file_name: str = "marker.txt") -> None:
            self.file_name = file_name

        @classmethod
        def check_settings(cls, declared, settings, trainer):
            print("marker: check_settings", file=sys.stderr)
            if "/" in declared.file_name:
                return [("file_name", f"{declared.file_name!r} is a path; give a file name")]
            return []

        @classmethod
        def check_together(cls, declared, settings):
            names = [spec.file_name for _, spec in declared]
            if len(set(names)) < len(names):
                return [" and ".join(f"hooks[{i}]" for i, _ in declared) + ": both write one file"]
            return []

        def on_after_train(self, trainer):
            (trainer.workspace / self.file_name).write_text("done")


    class MarkerTrainer(CliTrainer):
        """CliTrainer, in the module that registers "marker"."""
    '''
)


def stage(tmp_path, hooks):
    (tmp_path / "my_hooks.py").write_text(MY_HOOKS)
    settings = {"trainer": "my_hooks:MarkerTrainer", "max_steps": 2, "workspace": "ws", "hooks": hooks}
    (tmp_path / "run.json").write_text(json.dumps(settings))


ENV = {"PYTHONDONTWRITEBYTECODE": "1"}  # importing my_hooks.py writes nothing either


@pytest.mark.parametrize(
    ("hooks", "line"),
    [
        ([{"type": "marker", "file_name": "a/b.txt"}], "run.json: hooks[0].file_name: 'a/b.txt' is a path; give a file name"),
        ([{"type": "marker"}, {"type": "marker"}], "run.json: hooks[0] and hooks[1]: both write one file"),
    ],
)
def test_validate_refuses_what_run_refuses_for_a_users_hook(tmp_path, hooks, line):
    roots = {command: tmp_path / command for command in ("validate", "run")}
    processes = {}
    for command, root in roots.items():
        root.mkdir()
        stage(root, hooks)
        processes[command] = Cli(command, "run.json", cwd=root, env=cli_env(**ENV))
    for command, process in processes.items():
        result = process.result()
        assert result.returncode == 2
        assert result.stdout == ""
        errors = [text for text in result.stderr.splitlines() if not text.startswith("marker: ")]
        assert errors == [f"trainloop {command}: error: {line}"]
        assert_one_clean_error("\n".join(errors))
        assert sorted(p.name for p in roots[command].iterdir()) == ["my_hooks.py", "run.json"]  # nothing written


def test_the_preflight_runs_once_per_command(tmp_path):
    roots = {command: tmp_path / command for command in ("validate", "run")}
    processes = {}
    for command, root in roots.items():
        root.mkdir()
        stage(root, [{"type": "marker"}])
        processes[command] = Cli(command, "run.json", cwd=root, env=cli_env(**ENV))
    for command, process in processes.items():
        result = process.result()
        assert result.returncode == 0, result.stderr
        assert result.stderr.count("marker: check_settings") == 1, (command, result.stderr)
    assert (roots["run"] / "ws" / "marker.txt").read_text() == "done"


@pytest.fixture
def counted_hook():
    asked: list[str] = []

    @register_hook("counted")
    class Counted(BaseHook):
        def __init__(self, limit: int = 1) -> None:
            self.limit = limit

        @classmethod
        def check_settings(cls, declared, settings, trainer):
            asked.append(type(trainer).__name__)
            return [("limit", "must be positive")] if declared.limit < 1 else []

    yield asked
    unregister_hook("counted")


def test_plain_train_asks_the_hook_once_and_refuses_before_writing(tmp_path, counted_hook):
    TinyTrainer(TrainerSettings(max_steps=1, hooks=[{"type": "counted"}])).train()
    assert counted_hook == ["TinyTrainer"]  # the instance is asked, once
    settings = TrainerSettings(max_steps=1, workspace=tmp_path / "ws", hooks=[{"type": "counted", "limit": 0}])
    with pytest.raises(PreflightError) as info:
        TinyTrainer(settings).train()
    assert info.value.problems == ["hooks[0].limit: must be positive"]
    assert not (tmp_path / "ws").exists()


@pytest.mark.parametrize("answer", ["must be positive", [("limit",)], None])
def test_a_check_that_answers_in_the_wrong_shape_is_named(tmp_path, answer):
    @register_hook("misshapen")
    class Misshapen(BaseHook):
        @classmethod
        def check_settings(cls, declared, settings, trainer):
            return answer

    try:
        settings = TrainerSettings(max_steps=1, workspace=tmp_path / "ws", hooks=[{"type": "misshapen"}])
        with pytest.raises(TypeError, match=r"Misshapen.check_settings returned .*: it must return a list of"):
            TinyTrainer(settings).train()
        assert not (tmp_path / "ws").exists()
    finally:
        unregister_hook("misshapen")
