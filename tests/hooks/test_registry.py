"""Hooks declared in settings: validated like keyword arguments, built in the order given."""

import json

import pytest
from pydantic import ValidationError
from tiny_trainer import TinyTrainer, make_data
from torch.utils.data import DataLoader

from trainloop import BaseHook, CheckpointingHook, ProgressHook, TrainerSettings
from trainloop.hooks import HOOK_TYPES, hook_settings_model
from trainloop.hooks.registry import register_hook


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
    assert [type(h) for h in trainer.hooks] == [ProgressHook, CheckpointingHook]
    assert trainer.hooks[1].interval == 2
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
