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
    assert s.detect_non_finite_grads
    assert s.no_sync_accumulate
    assert not s.trace
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


def test_unknown_key_is_an_error_in_the_command_lines_words():
    # One voice: a keyword typo reads as `trainloop validate` reads the same key in a file.
    with pytest.raises(ValidationError, match="max_step\n  unknown setting 'max_step'; did you mean 'max_steps'\\?") as info:
        TinyTrainer(max_step=5)
    assert [e["loc"] for e in info.value.errors()] == [("max_step",)]
    with pytest.raises(ValidationError, match=r"hooks\.0\.intervall\n  unknown setting 'intervall'; did you mean 'interval'\?"):
        TrainerSettings(max_steps=5, hooks=[{"type": "checkpointing", "interval": 1, "intervall": 2}])


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
        ("bad.json", '{"max_steps": 0}', r"bad\.json: max_steps: Input should be greater than 0 \(got 0\)$"),
        ("bad.json", '{"max_steps": 4,', r"bad\.json: malformed JSON"),
        ("bad.yaml", "max_steps: [1,\n", r"bad\.yaml: malformed YAML"),
        ("bad.toml", "max_steps = \n", r"bad\.toml: malformed TOML"),
        ("bad.json", "[1, 2]", r"bad\.json: expected a mapping of settings, got list"),
        ("bad.json", '{"max_steps": 3, "lr": 0.1}', r"bad\.json: lr: unknown setting 'lr'; valid here: max_steps, "),
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
    assert trainer.settings.lr == 0.5
    assert trainer.settings.hidden_dim == 8
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
    assert settings.hooks[0].interval == 4
    assert settings.trace is True
    assert settings.gradient_accumulation_steps == 1  # the default, untouched
    assert TrainerSettings.load(path, env=env).max_steps == 7


def test_env_and_overrides_without_a_file():
    settings = TrainerSettings.load(env={"TRAINLOOP_MAX_STEPS": "3", "TRAINLOOP_HOOKS": '[{"type": "ema", "decay": 0.5}]'})
    assert settings.max_steps == 3
    assert settings.hooks[0].decay == 0.5


@pytest.mark.parametrize(
    ("overrides", "env", "message"),
    [
        (["max_steps"], {}, r"override 'max_steps': expected key=value"),
        (["hooks.2.interval=1"], {}, r"hooks\.2 is not an item of a 1-item list"),
        (["max_steps.x=1"], {}, r"max_steps is not a mapping"),
        ([], {"TRAINLOOP_MAX_STEPS": "ten"}, r"^TRAINLOOP_MAX_STEPS: max_steps: Input should be a valid integer.* \(got 'ten'\)$"),
        (['mixed_precision="fp8"'], {}, r"""^--set mixed_precision="fp8": mixed_precision: Input should be 'bf16' or 'fp16' \(got 'fp8'\)$"""),
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
        hooks=[{"type": "checkpointing", "interval": 5}, {"type": "validation", "evaluate": "val_metrics", "interval": 2}],
    )
    assert TrainerSettings.model_validate_json(settings.model_dump_json()) == settings


def test_a_warmup_as_long_as_the_run_is_allowed_a_smoke_run_of_long_settings():
    settings = TrainerSettings(max_steps=4, lr_schedule={"name": "linear", "warmup_steps": 4})
    assert settings.lr_schedule.warmup_steps == 4  # the schedule warns when it is built


def test_schema_file_is_current():
    schema_file = Path(__file__).resolve().parents[2] / "schemas" / "trainer_settings.schema.json"
    assert json.loads(schema_file.read_text()) == TrainerSettings.json_schema(), (
        "schemas/trainer_settings.schema.json is stale: run `trainloop schema --output schemas/trainer_settings.schema.json`"
    )
    assert "$schema" in TrainerSettings.json_schema()["properties"]


# -- layers: nested environment variables, overrides by hook type, errors as the user wrote them --


def test_nested_environment_variables_reach_every_nested_field():
    env = {
        "TRAINLOOP_OPTIMIZER__NAME": "SGD",
        "TRAINLOOP_OPTIMIZER__LR": "0.5",
        "trainloop_lr_schedule__name": "cosine",
        "TRAINLOOP_LR_SCHEDULE__WARMUP_STEPS": "10",  # JSON: the integer 10, not the text "10"
        "TRAINLOOP_HOOKS": '[{"type": "checkpointing", "interval": 3}]',
        "TRAINLOOP_HOOKS__CHECKPOINTING__INTERVAL": "7",  # a hook addressed by its type
        "TRAINLOOP_HOOKS__0__KEEP_PREVIOUS": "2",  # or by index
    }
    settings = TrainerSettings.load(env={"TRAINLOOP_MAX_STEPS": "100", **env})
    assert (settings.optimizer.name, settings.optimizer.kwargs["lr"]) == ("SGD", 0.5)
    assert settings.lr_schedule.warmup_steps == 10
    assert (settings.hooks[0].interval, settings.hooks[0].keep_previous) == (7, 2)


@pytest.mark.parametrize(
    ("env", "line"),
    [
        ({"TRAINLOOP_OPTIMIZER__LR": "0.5"}, "TRAINLOOP_OPTIMIZER__LR: optimizer: needs a 'name' key (got {'lr': 0.5})"),
        (
            {"TRAINLOOP_OPTIMIZER__NAME": "SGD", "TRAINLOOP_OPTIMIZER__LR": "[1]"},
            "TRAINLOOP_OPTIMIZER__LR: optimizer.lr: Input should be a valid number (got [1])",
        ),
        ({"TRAINLOOP_SEEED": "3"}, "TRAINLOOP_SEEED: seeed: unknown setting 'seeed'; did you mean 'seed'?"),
        (
            {"TRAINLOOP_LR_SCHEDULE__NAME": "cosine", "TRAINLOOP_LR_SCHEDULE__WARMUP_STEPS": '"10"'},
            "TRAINLOOP_LR_SCHEDULE__WARMUP_STEPS: lr_schedule.warmup_steps: Input should be a valid integer "
            "(got '10'); '10' is text, not a number",
        ),
    ],
)
def test_an_environment_error_names_the_variable(tmp_path, env, line):
    path = tmp_path / "run.json"
    path.write_text('{"max_steps": 20}')
    with pytest.raises(SettingsFileError) as info:
        TrainerSettings.load(path, env=env)
    assert info.value.problems == [line]


def test_overrides_address_a_hook_by_its_type():
    settings = TrainerSettings.load(
        env={}, overrides=["max_steps=5", 'hooks=[{"type": "progress"}, {"type": "checkpointing", "interval": 2}]',
                           "hooks.checkpointing.interval=500", "hooks.progress.interval=3"],
    )
    assert (settings.hooks[0].interval, settings.hooks[1].interval) == (3, 500)
    two = 'hooks=[{"type": "ema"}, {"type": "ema"}]'
    with pytest.raises(SettingsFileError, match=r"hooks has 2 items of type 'ema' \(items 0, 1\): address one by index \(hooks\.0\)"):
        TrainerSettings.load(env={}, overrides=[two, "hooks.ema.decay=0.5"])
    with pytest.raises(SettingsFileError, match=r"^--set hooks.stats.interval=2: hooks has no item of type 'stats' \(its items' types are ema, ema\)"):
        TrainerSettings.load(env={}, overrides=[two, "hooks.stats.interval=2"])


@pytest.mark.parametrize(
    ("text", "lines"),
    [
        # A value two types allow: one line, under the field's own name, no pydantic tags.
        (
            "max_steps: 5\nhooks: [{type: checkpointing, interval: 2, exit_code: 300, load: 5}]\n",
            [
                "run.yaml: hooks[0].load: Input should be 'latest' or a path or a URL (got 5)",
                "run.yaml: hooks[0].exit_code: Input should be '128+signal' or less than or equal to 255 (got 300)",
            ],
        ),
        # YAML 1.1 reads 3e-3 as text.
        (
            "max_steps: 5\noptimizer: {name: AdamW, lr: 3e-3}\n",
            [
                "run.yaml: optimizer.lr: Input should be a valid number (got '3e-3'); '3e-3' is text, not a number "
                "(YAML reads an exponent without a dot as text: write 3.0e-3)"
            ],
        ),
        # Unknown keys: a close valid name is suggested, at the top level and in a hook.
        (
            "max_step: 5\nhooks: [{type: progress, intervl: 3}]\n",
            [
                # (max_steps is optional beside max_epochs: "the run needs an end" follows
                # once the keys are right, from the settings-wide check.)
                "run.yaml: hooks[0].intervl: unknown setting 'intervl'; did you mean 'interval'?",
                "run.yaml: max_step: unknown setting 'max_step'; did you mean 'max_steps'?",
            ],
        ),
        # A required field misspelt is one mistake: the unknown key's line, not also "field required".
        (
            "max_steps: 5\nhooks: [{type: checkpointing, intervall: 3}]\n",
            ["run.yaml: hooks[0].intervall: unknown setting 'intervall'; did you mean 'interval'?"],
        ),
        (
            "max_steps: 5\noptimizer: {name: Adamw}\n",
            ["run.yaml: optimizer: unknown name 'Adamw' (did you mean 'AdamW'?); expected one of 'ASGD', 'Adadelta', "
             "'Adafactor', 'Adagrad', 'Adam', 'AdamW', 'Adamax', 'LBFGS', 'Muon', 'NAdam', 'RAdam', 'RMSprop', 'Rprop', "
             "'SGD', 'SparseAdam' (got {'name': 'Adamw'})"],
        ),
    ],
)
def test_errors_are_one_line_per_field_as_written(tmp_path, text, lines):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(SettingsFileError) as info:
        TrainerSettings.load(path, env={})
    assert [line.replace(str(path), "run.yaml") for line in info.value.problems] == lines
    assert not any(tag in str(info.value) for tag in ("literal[", "lax-or-strict", "function-after"))


def test_a_file_that_is_not_utf8_is_a_settings_file_error(tmp_path):
    path = tmp_path / "run.json"
    path.write_bytes('{"max_steps": 3, "workspace": "r\u00e9sum\u00e9"}'.encode("latin-1"))
    with pytest.raises(SettingsFileError, match=r"run\.json: not a UTF-8 text file \(byte 0xe9 at offset 32\); save it as UTF-8"):
        TrainerSettings.from_file(path)


def test_a_settings_file_names_its_trainer(tmp_path):
    assert TrainerSettings(max_steps=1, trainer="my_project.train:MyTrainer").trainer == "my_project.train:MyTrainer"
    with pytest.raises(ValidationError, match="trainer"):
        TrainerSettings(max_steps=1, trainer="my_project.train.MyTrainer")


def test_an_error_about_a_mapping_names_every_layer_that_set_part_of_it(tmp_path):
    path = tmp_path / "run.json"
    path.write_text('{"max_steps": 3, "optimizer": {"name": "AdamW", "lr": 0.1}}')
    with pytest.raises(SettingsFileError) as info:
        TrainerSettings.load(path, env={"TRAINLOOP_OPTIMIZER__WEIGHT_DECY": "0.1"})
    (line,) = info.value.problems
    assert line.startswith(
        f"{path}, TRAINLOOP_OPTIMIZER__WEIGHT_DECY: optimizer: unknown argument(s) 'weight_decy' for AdamW "
        "(did you mean 'weight_decay'?); valid arguments: "
    )


def test_a_key_set_under_a_value_that_names_a_file_says_where_it_goes(tmp_path):
    # deepspeed: ds.json, and --set deepspeed.zero_optimization.stage=3: the key belongs in the file.
    path = tmp_path / "run.json"
    path.write_text('{"max_steps": 2, "deepspeed": "ds.json"}')
    with pytest.raises(SettingsFileError) as error:
        TrainerSettings.load(path, overrides=["deepspeed.zero_optimization.stage=3"])
    assert str(error.value) == (
        "--set deepspeed.zero_optimization.stage=3: deepspeed is 'ds.json', not a mapping, so it has no "
        "'zero_optimization': where 'ds.json' names a file, set 'zero_optimization' in it, or replace the whole "
        "value (deepspeed=...)"
    )
