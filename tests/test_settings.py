import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from tiny_trainer import TinyTrainer

from trainloop import BaseTrainer, SettingsFileError, TrainerSettings


def test_keywords_settings_object_and_file_give_one_frozen_settings(tmp_path):
    from_kwargs = TinyTrainer(max_steps=7, grad_clip=1.0, mixed_precision="bf16", workspace=tmp_path).settings
    from_object = TinyTrainer(TrainerSettings(max_steps=7, grad_clip=1.0, mixed_precision="bf16", workspace=tmp_path)).settings
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"max_steps": 7, "grad_clip": 1.0, "mixed_precision": "bf16", "workspace": str(tmp_path)}))
    from_file = TinyTrainer(TrainerSettings.from_file(path)).settings
    assert from_kwargs == from_object == from_file
    assert from_kwargs.workspace == Path(tmp_path)
    with pytest.raises(ValidationError, match="frozen"):
        from_kwargs.max_steps = 3  # type: ignore[misc]


def test_keywords_override_a_settings_object():
    base = TrainerSettings(max_steps=7, grad_clip=2.0)
    settings = TinyTrainer(base, max_steps=3).settings
    assert (settings.max_steps, settings.grad_clip) == (3, 2.0)
    assert base.max_steps == 7


def test_defaults():
    s = TrainerSettings(max_steps=1)
    assert s.gradient_accumulation_steps == 1
    assert s.max_non_finite_grad_retries is None
    assert s.detect_non_finite_grads and s.no_sync_accumulate and not s.trace
    assert TrainerSettings(max_steps=1, gradient_accumulation_steps=None).gradient_accumulation_steps == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_steps", 0),
        ("max_steps", "10"),  # strings are not silently taken for numbers
        ("max_steps", 2.5),
        ("gradient_accumulation_steps", 0),
        ("grad_clip", -1.0),
        ("grad_clip", 0.0),
        ("max_non_finite_grad_retries", -1),
        ("mixed_precision", "fp8"),
        ("device", "tpu:0:x"),
        ("trace", "yes"),
        ("no_sync_accumulate", 1),
    ],
)
def test_invalid_values_name_the_field(field, value):
    kwargs = {"max_steps": 5, field: value}
    with pytest.raises(ValidationError) as info:
        TinyTrainer(**kwargs)
    assert [e["loc"][0] for e in info.value.errors()] == [field]


def test_unknown_key_is_an_error():
    with pytest.raises(ValidationError, match="max_step\n.*Extra inputs are not permitted"):
        TinyTrainer(max_step=5)


def test_a_run_without_an_end_is_an_error():
    with pytest.raises(ValidationError, match="give max_steps, max_epochs or both"):
        TinyTrainer()
    with pytest.raises(ValidationError, match="max_epochs\n.*greater than 0"):
        TinyTrainer(max_epochs=0)
    with pytest.raises(ValidationError, match="max_epochs\n.*valid integer"):
        TrainerSettings.model_validate({"max_epochs": "2"})


def test_device_is_normalised():
    assert TrainerSettings(max_steps=1, device=torch.device("cpu")).device == "cpu"
    assert TinyTrainer(max_steps=1, device="cpu").device == torch.device("cpu")


def test_a_positional_that_is_not_settings_is_a_clear_error():
    with pytest.raises(TypeError, match="max_steps=1000"):
        TinyTrainer(100)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("run.json", '{"$schema": "schema.json", "max_steps": 4, "grad_clip": 0.5}'),
        ("run.yaml", "max_steps: 4\ngrad_clip: 0.5\n"),
        ("run.toml", "max_steps = 4\ngrad_clip = 0.5\n"),
    ],
)
def test_from_file_formats(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    assert TrainerSettings.from_file(path) == TrainerSettings(max_steps=4, grad_clip=0.5)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("bad.json", '{"max_steps": 0}', r"(?s)bad\.json: .*max_steps\n.*greater than 0"),
        ("bad.json", '{"max_steps": 4,', r"bad\.json: malformed JSON"),
        ("bad.yaml", "max_steps: [1,\n", r"bad\.yaml: malformed YAML"),
        ("bad.toml", "max_steps = \n", r"bad\.toml: malformed TOML"),
        ("bad.json", "[1, 2]", r"bad\.json: expected a mapping of settings, got list"),
        ("bad.json", '{"max_steps": 3, "lr": 0.1}', r"(?s)bad\.json: .*lr\n.*Extra inputs"),
        ("bad.ini", "max_steps=3", r"bad\.ini: unknown settings file type '\.ini'"),
    ],
)
def test_bad_files_name_the_file_and_field(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(SettingsFileError, match=message):
        TrainerSettings.from_file(path)


def test_missing_file_names_the_file(tmp_path):
    with pytest.raises(SettingsFileError, match=r"nope\.json: cannot read settings file"):
        TrainerSettings.from_file(tmp_path / "nope.json")


class MySettings(TrainerSettings):
    lr: float = 1e-3
    hidden_dim: int = 8


class MyTrainer(BaseTrainer):
    settings_class = MySettings


def test_a_trainer_declares_its_own_settings(tmp_path):
    trainer = MyTrainer(max_steps=3, lr=0.5)
    assert isinstance(trainer.settings, MySettings)
    assert trainer.settings.lr == 0.5 and trainer.settings.hidden_dim == 8
    path = tmp_path / "run.json"
    path.write_text('{"max_steps": 3, "hidden_dim": 16}')
    assert MyTrainer(MySettings.from_file(path)).settings.hidden_dim == 16
    # A base TrainerSettings is re-validated into the subclass, taking its defaults.
    assert MyTrainer(TrainerSettings(max_steps=2)).settings == MySettings(max_steps=2)
    with pytest.raises(ValidationError, match="hidden_dim"):
        MyTrainer(max_steps=3, hidden_dim="big")


def test_precedence_defaults_file_env_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("max_steps: 5\ngrad_clip: 1.0\nmixed_precision: bf16\nhooks:\n  - {type: progress, interval: 3}\n")
    env = {"TRAINLOOP_GRAD_CLIP": "2.5", "trainloop_max_steps": "7", "UNRELATED": "x"}
    settings = TrainerSettings.load(path, env=env, overrides=["max_steps=9", "hooks.0.interval=4", "trace=true"])
    assert (settings.max_steps, settings.grad_clip, settings.mixed_precision) == (9, 2.5, "bf16")
    assert settings.hooks[0].interval == 4 and settings.trace is True
    assert settings.gradient_accumulation_steps == 1  # the default, untouched
    assert TrainerSettings.load(path, env=env).max_steps == 7


def test_env_and_overrides_without_a_file():
    settings = TrainerSettings.load(env={"TRAINLOOP_MAX_STEPS": "3", "TRAINLOOP_HOOKS": '[{"type": "ema", "decay": 0.5}]'})
    assert settings.max_steps == 3 and settings.hooks[0].decay == 0.5


@pytest.mark.parametrize(
    ("overrides", "env", "message"),
    [
        (["max_steps"], {}, r"override 'max_steps': expected key=value"),
        (["hooks.2.interval=1"], {}, r"hooks\.2 is not an item of a 1-item list"),
        (["max_steps.x=1"], {}, r"max_steps is not a mapping"),
        ([], {"TRAINLOOP_MAX_STEPS": "ten"}, r"(?s)run\.json: .*max_steps\n.*valid integer"),
        (['mixed_precision="fp8"'], {}, r"(?s)mixed_precision\n"),
    ],
)
def test_bad_env_and_overrides_are_clear_errors(tmp_path, overrides, env, message):
    path = tmp_path / "run.json"
    path.write_text('{"max_steps": 2, "hooks": [{"type": "progress"}]}')
    with pytest.raises(SettingsFileError, match=message):
        TrainerSettings.load(path, env=env, overrides=overrides)


def test_settings_round_trip_through_json():
    settings = TrainerSettings(
        max_steps=10, grad_clip=1.0, workspace="runs/a", seed=3,
        optimizer={"name": "AdamW", "lr": 1e-3, "betas": [0.9, 0.95], "no_weight_decay": ["bias", "norm"]},
        lr_schedule={"name": "cosine", "warmup_ratio": 0.1},
        hooks=[{"type": "checkpointing", "interval": 5}, {"type": "validation", "evaluate": "evaluate", "interval": 2}],
    )
    assert TrainerSettings.model_validate_json(settings.model_dump_json()) == settings


def test_a_warmup_as_long_as_the_run_is_rejected():
    with pytest.raises(ValidationError, match=r"warmup \(4 steps\) must be shorter than max_steps \(4\)"):
        TrainerSettings(max_steps=4, lr_schedule={"name": "linear", "warmup_steps": 4})


def test_schema_file_is_current():
    schema_file = Path(__file__).resolve().parents[1] / "schemas" / "trainer_settings.schema.json"
    assert json.loads(schema_file.read_text()) == TrainerSettings.json_schema(), (
        "schemas/trainer_settings.schema.json is stale: run `trainloop schema --output schemas/trainer_settings.schema.json`"
    )
    assert "$schema" in TrainerSettings.json_schema()["properties"]
