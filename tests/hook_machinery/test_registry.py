"""Hooks declared in settings: validated like keyword arguments, built in the order given."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_process import Cli
from helper_hooks import CaptureHook
from pydantic import ValidationError
from tiny_trainer import TinyTrainer, make_data
from torch.utils.data import DataLoader

from trainloop import BaseHook, CheckpointingHook, LoggingHook, ProgressHook, TrainerSettings
from trainloop.hook_machinery.registry import register_hook, unregister_hook, with_default_hooks
from trainloop.hooks import HOOK_TYPES, hook_settings_model


class DeclaredTrainer(TinyTrainer):
    """TinyTrainer that leaves build_hooks to the settings."""

    def build_hooks(self):
        return super(TinyTrainer, self).build_hooks()


def test_every_builtin_hook_is_declarable():
    assert set(HOOK_TYPES) >= {
        "checkpointing", "cuda_memory", "early_stopping", "ema", "image_files", "logging", "progress",
        "stats", "tensorboard", "validation", "wandb",
    }
    for name, cls in HOOK_TYPES.items():
        schema = hook_settings_model(cls).model_json_schema()  # every declarable hook has one
        assert schema["properties"]["type"]["const"] == name
        assert schema["additionalProperties"] is False


def test_declared_hooks_are_built_in_order_and_run(tmp_path):
    settings = TrainerSettings.model_validate(
        {
            "max_steps": 4,
            "workspace": str(tmp_path),
            "hooks": [{"type": "progress", "interval": 2}, {"type": "checkpointing", "interval": 2}],
        }
    )
    trainer = DeclaredTrainer(settings, data=DataLoader(make_data(), batch_size=8))
    trainer.train()
    # Led by the default LoggingHook: the run has a workspace and declares no logging hook.
    assert [type(h) for h in trainer.hooks] == [LoggingHook, ProgressHook, CheckpointingHook]
    assert trainer.hooks[2].interval == 2
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["4", "latest"]


def test_declared_hooks_round_trip_through_json():
    settings = TrainerSettings(max_steps=2, hooks=[{"type": "checkpointing", "interval": 5, "exit_signals": ["SIGTERM"]}])
    again = TrainerSettings.model_validate_json(settings.model_dump_json())
    assert again == settings


@pytest.mark.parametrize(
    ("hook", "location"),
    [
        ({"type": "checkpointing"}, ("hooks", 0, "interval")),
        ({"type": "checkpointing", "interval": "5"}, ("hooks", 0, "interval")),
        ({"type": "progress", "colour": "red"}, ("hooks", 0, "colour")),
        ({"type": "teleport"}, ("hooks", 0)),
        ({"interval": 3}, ("hooks", 0)),
    ],
)
def test_bad_declared_hooks_name_the_entry_and_field(hook, location):
    with pytest.raises(ValidationError) as info:
        TrainerSettings(max_steps=2, hooks=[hook])
    assert info.value.errors()[0]["loc"] == location


def test_a_settings_file_declares_hooks(tmp_path):
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"max_steps": 2, "hooks": [{"type": "ema", "decay": 0.9}]}))
    (spec,) = TrainerSettings.from_file(path).hooks
    assert spec.build().decay == 0.9


def test_registering_a_taken_name_is_an_error():
    with pytest.raises(ValueError, match="hook type 'progress' is already registered by ProgressHook"):
        register_hook("progress")(type("Other", (BaseHook,), {}))


@pytest.fixture
def registry_restored():
    """Hooks a test registers are forgotten afterwards (the docs and schema list the registry)."""
    before = dict(HOOK_TYPES)
    yield
    HOOK_TYPES.clear()
    HOOK_TYPES.update(before)


def test_a_hook_registered_after_import_is_declarable(registry_restored):
    import trainloop

    assert trainloop.register_hook is register_hook  # public

    @trainloop.register_hook("every_n")
    class EveryN(BaseHook):
        def __init__(self, n: int = 2) -> None:
            self.n = n
            self.seen = []

        def on_after_step(self, trainer):
            if trainer.step % self.n == 0:
                self.seen.append(trainer.step)

    settings = TrainerSettings.model_validate({"max_steps": 4, "hooks": [{"type": "every_n", "n": 2}]})
    assert TrainerSettings.model_validate_json(settings.model_dump_json()) == settings
    schema = TrainerSettings.json_schema()
    assert schema["properties"]["hooks"]["items"]["discriminator"]["mapping"]["every_n"] == "#/$defs/EveryNSettings"
    trainer = DeclaredTrainer(settings)
    trainer.train()
    assert trainer.hooks[0].seen == [2, 4]


def test_declared_hooks_run_after_the_built_ones_and_are_never_dropped(tmp_path):
    settings = TrainerSettings(max_steps=2, workspace=tmp_path, hooks=[{"type": "checkpointing", "interval": 2}])
    capture = CaptureHook()
    trainer = TinyTrainer(settings, hooks=[capture])  # overrides build_hooks() with its own hooks
    trainer.train()
    assert [type(h) for h in trainer.hooks] == [LoggingHook, CaptureHook, CheckpointingHook]  # LoggingHook: the default
    assert (tmp_path / "checkpoints" / "2").is_dir()  # the declared hook ran
    assert capture.calls  # and so did the built one


def test_a_declared_hook_built_by_an_override_is_not_built_twice():
    class BuildsDeclared(TinyTrainer):
        def build_hooks(self):  # the pattern of older code: build the declared hooks itself
            return [spec.build() for spec in self.settings.hooks]

    trainer = BuildsDeclared(TrainerSettings(max_steps=2, hooks=[{"type": "progress"}, {"type": "progress"}]))
    trainer.train()
    assert [type(h) for h in trainer.hooks] == [ProgressHook, ProgressHook]


def _doc_example(name: str) -> str:
    """The code block under ``<!-- example: name -->`` in docs/hooks.md."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "hooks.md").read_text()
    after = text.split(f"<!-- example: {name} -->\n", 1)[1]
    return after.split("```", 2)[1].split("\n", 1)[1]


def test_the_custom_hook_example_of_the_docs_runs_from_the_cli(tmp_path):
    (tmp_path / "my_train.py").write_text(_doc_example("my_train.py"))
    (tmp_path / "run.json").write_text(_doc_example("run.json"))
    run = Cli("run", "run.json", cwd=tmp_path)
    schema = Cli("schema", "--trainer", "my_train:MyTrainer", cwd=tmp_path)
    result = run.result()
    assert result.returncode == 0, result.stderr
    lines = (tmp_path / "runs" / "custom" / "loss.txt").read_text().splitlines()
    assert [int(line.split()[0]) for line in lines] == [5, 10, 15, 20]
    result = schema.result()
    assert result.returncode == 0, result.stderr
    hook_types = json.loads(result.stdout)["properties"]["hooks"]["items"]["discriminator"]["mapping"]
    assert "loss_file" in hook_types
    assert "checkpointing" in hook_types


def test_a_hook_object_in_settings_says_where_objects_go():
    from trainloop import ValidationHook

    with pytest.raises(ValueError) as info:
        TrainerSettings(max_steps=2, hooks=[ValidationHook(evaluate="val_metrics", interval=2)])
    message = str(info.value)
    assert "settings.hooks holds hooks as data, not ValidationHook objects: return hook objects from build_hooks()" in message
    assert '"type": "validation"' in message
    assert "{{" not in message


def test_a_built_in_hook_is_declarable_where_only_the_settings_were_imported():
    # The settings import the machinery alone; the first lookup of a type imports the hook library.
    code = (
        "import sys\n"
        "from trainloop.settings import TrainerSettings\n"
        "assert 'trainloop.hooks' not in sys.modules\n"
        "settings = TrainerSettings(max_steps=2, hooks=[{'type': 'checkpointing', 'interval': 2}])\n"
        "print(type(settings.hooks[0]).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "CheckpointingHookSettings"


def test_the_hooks_a_run_adds_by_itself_come_from_the_classes_that_define_them(tmp_path):
    class QuietLogging(LoggingHook):  # inherits LoggingHook.default_hook: adds no second default
        pass

    register_hook("quiet_logging")(QuietLogging)
    try:
        settings = TrainerSettings(max_steps=2, workspace=tmp_path)
        (added,) = with_default_hooks([], settings)
        assert type(added) is LoggingHook
        assert added.interval == 10
        declared = [QuietLogging(interval=5)]
        assert with_default_hooks(declared, settings) == declared  # something logs already
        assert with_default_hooks([], TrainerSettings(max_steps=2)) == []  # no workspace, no metrics.jsonl
    finally:
        unregister_hook("quiet_logging")


def test_a_parameter_without_an_annotation_is_declarable_and_takes_any_value():
    class Unannotated(BaseHook):
        def __init__(self, every, prefix="step") -> None:
            self.every, self.prefix = every, prefix

    register_hook("test_unannotated")(Unannotated)
    try:
        model = hook_settings_model(Unannotated)
        assert list(model.model_fields) == ["type", "name", "every", "prefix"]
        hook = model(type="test_unannotated", every=[1, 2]).build()
        assert (hook.every, hook.prefix) == ([1, 2], "step")
        with pytest.raises(ValidationError, match=r"every\n  Field required"):
            model(type="test_unannotated")
    finally:
        unregister_hook("test_unannotated")
