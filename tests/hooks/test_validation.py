"""ValidationHook: when it evaluates, in which mode, what it logs, and how it fails."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pydantic
import pytest
import torch
from helper_hooks import CaptureHook
from tiny_trainer import TinyTrainer, make_data
from torch.utils.data import DataLoader

from trainloop import BaseHook, State
from trainloop.hook_machinery.registry import HOOK_TYPES, hook_settings_model
from trainloop.hooks.validation import ValidationHook

ROOT = Path(__file__).resolve().parents[2]


class Probe:
    """An evaluation that records the conditions it ran under and returns the validation MSE."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def __call__(self, trainer):
        x, y = make_data(16, seed=1).tensors
        out = trainer.model(x)
        self.seen.append(
            {
                "step": trainer.step,
                "grad_enabled": torch.is_grad_enabled(),
                "modes": [m.training for m in trainer.model.modules()],
                "autocast": torch.is_autocast_enabled("cpu"),
                "out_dtype": out.dtype,
                "out_requires_grad": out.requires_grad,
            }
        )
        return {"loss": torch.nn.functional.mse_loss(out.float(), y), "n": 16}


class ModeRecorder(BaseHook):
    """Placed after the ValidationHook: the modules' modes once the step's hooks have run."""

    def __init__(self) -> None:
        self.modes: list[list[bool]] = []

    def on_after_step(self, trainer):
        self.modes.append([m.training for m in trainer.model.modules()])


def val_logs(capture: CaptureHook) -> list[dict]:
    return [r["val"] for r in capture.logged if "val" in r]


def test_runs_at_interval_and_last_step_in_eval_mode_without_grad(tmp_path):
    probe, capture, modes = Probe(), CaptureHook(), ModeRecorder()
    hook = ValidationHook(probe, interval=3)
    trainer = TinyTrainer(max_steps=10, hooks=[hook, modes, capture], workspace=tmp_path)
    trainer.train()

    assert [s["step"] for s in probe.seen] == [3, 6, 9, 10]
    for seen in probe.seen:
        assert seen["grad_enabled"] is False
        assert seen["out_requires_grad"] is False
        assert not any(seen["modes"])  # every submodule in eval mode
        assert seen["autocast"] is False  # no mixed precision in these settings
    # Train mode is back after each evaluation, and training itself still had gradients.
    assert modes.modes == [[True] * 4] * 10
    assert torch.is_grad_enabled()
    logs = val_logs(capture)
    assert len(logs) == 4
    assert all(set(r) == {"loss", "n"} for r in logs)
    assert hook.last_step == 10
    assert hook.last_records is logs[-1]
    assert float(hook.last_records["loss"]) > 0


def test_at_last_step_false_and_interval_dividing_max_steps(tmp_path):
    probe = Probe()
    TinyTrainer(max_steps=10, hooks=[ValidationHook(probe, interval=3, at_last_step=False)]).train()
    assert [s["step"] for s in probe.seen] == [3, 6, 9]

    probe = Probe()  # the last step is a multiple of interval: evaluated once, not twice
    TinyTrainer(max_steps=6, hooks=[ValidationHook(probe, interval=3)]).train()
    assert [s["step"] for s in probe.seen] == [3, 6]


def test_custom_prefix(tmp_path):
    capture = CaptureHook()
    hook = ValidationHook(lambda trainer: {"acc": 0.5}, interval=2, prefix="test")
    TinyTrainer(max_steps=4, hooks=[hook, capture]).train()
    assert capture.logged == [{"test": {"acc": 0.5}}, {"test": {"acc": 0.5}}]


class FrozenFirstLayer(BaseHook):
    """Keeps the first layer in eval mode during training (as one freezes a BatchNorm)."""

    def on_before_step(self, trainer):
        trainer.model[0].eval()


def test_restores_mixed_submodule_modes(tmp_path):
    probe, modes = Probe(), ModeRecorder()
    hooks = [FrozenFirstLayer(), ValidationHook(probe, interval=2), modes]
    TinyTrainer(max_steps=4, hooks=hooks).train()
    # Sequential itself, Linear (frozen), Tanh, Linear.
    assert modes.modes == [[True, False, True, True]] * 4
    assert [s["modes"] for s in probe.seen] == [[False] * 4] * 2


def test_runs_under_the_trainers_autocast(tmp_path):
    probe = Probe()
    TinyTrainer(max_steps=2, mixed_precision="bf16", hooks=[ValidationHook(probe, interval=1)]).train()
    assert [(s["autocast"], s["out_dtype"]) for s in probe.seen] == [(True, torch.bfloat16)] * 2
    assert not torch.is_autocast_enabled("cpu")  # left again after the evaluation


class ValTrainer(TinyTrainer):
    """A trainer that owns its validation, as a settings file can name it."""

    not_a_method = 42

    def validate(self):
        self.validated_at = getattr(self, "validated_at", []) + [
            (self.step, torch.is_grad_enabled(), self.model.training)
        ]
        x, y = make_data(16, seed=1).tensors
        return {"loss": torch.nn.functional.mse_loss(self.model(x), y).item()}


def test_method_name_form(tmp_path):
    capture = CaptureHook()
    hook = ValidationHook("validate", interval=2)
    trainer = ValTrainer(max_steps=5, hooks=[hook, capture])
    trainer.train()
    assert trainer.validated_at == [(2, False, False), (4, False, False), (5, False, False)]
    logs = val_logs(capture)
    assert len(logs) == 3
    assert logs[-1] == hook.last_records
    assert isinstance(hook.last_records["loss"], float)
    assert trainer.model.training


def test_missing_method_fails_before_the_first_step():
    trainer = ValTrainer(max_steps=5, hooks=[ValidationHook("validat", interval=2)])
    with pytest.raises(AttributeError, match=r"ValTrainer has no method 'validat'"):
        trainer.train()
    assert trainer.step == 0
    assert trainer.state is State.EXITING


def test_non_callable_attribute_fails_before_the_first_step():
    trainer = ValTrainer(max_steps=5, hooks=[ValidationHook("not_a_method", interval=2)])
    with pytest.raises(TypeError, match=r"ValTrainer.not_a_method is a int, not a method"):
        trainer.train()
    assert trainer.step == 0


def test_evaluation_raising_restores_modes_and_ends_the_run():
    def broken(trainer):
        assert not trainer.model.training
        raise RuntimeError("validation data missing")

    hooks = [FrozenFirstLayer(), ValidationHook(broken, interval=3)]
    trainer = TinyTrainer(max_steps=10, hooks=hooks)
    with pytest.raises(RuntimeError, match="validation data missing"):
        trainer.train()
    assert trainer.step == 3
    assert trainer.state is State.EXITING
    assert [m.training for m in trainer.model.modules()] == [True, False, True, True]
    assert torch.is_grad_enabled()


def test_evaluation_returning_no_records_is_an_error():
    def returns_float(trainer):
        return 0.5

    trainer = TinyTrainer(max_steps=4, hooks=[ValidationHook(returns_float, interval=2)])
    with pytest.raises(TypeError, match=r"returns_float returned a float, not a dict of records"):
        trainer.train()
    assert trainer.model.training


def test_run_on_demand(tmp_path):
    """``run`` evaluates outside the schedule too (e.g. before training, from another hook)."""
    probe, capture = Probe(), CaptureHook()
    hook = ValidationHook(probe, interval=100)

    class Baseline(BaseHook):
        def on_before_train(self, trainer):
            self.records = hook.run(trainer)

    baseline = Baseline()
    TinyTrainer(max_steps=3, hooks=[baseline, hook, capture]).train()
    assert [s["step"] for s in probe.seen] == [0, 3]  # step 3 is the last step
    assert set(baseline.records) == {"loss", "n"}
    assert len(val_logs(capture)) == 2


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"evaluate": "validate", "interval": 0}, "interval"),
        ({"evaluate": "validate", "interval": -5}, "interval"),
        ({"evaluate": "validate", "interval": "10"}, "interval"),
        ({"evaluate": "validate", "interval": 2.5}, "interval"),
        ({"evaluate": "validate"}, "interval"),
        ({"evaluate": 3, "interval": 1}, "evaluate"),
        ({"evaluate": "2nd_validation", "interval": 1}, "evaluate"),
        ({"evaluate": "trainer.validate", "interval": 1}, "evaluate"),
        ({"evaluate": "validate", "interval": 1, "at_last_step": "yes"}, "at_last_step"),
        ({"evaluate": "validate", "interval": 1, "prefix": ""}, "prefix"),
    ],
)
def test_bad_parameters(kwargs, param):
    with pytest.raises(pydantic.ValidationError) as info:
        ValidationHook(**kwargs)
    assert {error["loc"][0] for error in info.value.errors()} == {param}


def test_registered_and_declarable_in_settings(tmp_path):
    assert HOOK_TYPES["validation"] is ValidationHook
    model = hook_settings_model(ValidationHook)
    schema = model.model_json_schema()  # must not choke on the callable branch
    assert schema["properties"]["evaluate"]["type"] == "string"
    assert "anyOf" not in schema["properties"]["evaluate"]
    assert set(schema["required"]) == {"type", "evaluate", "interval"}
    json.dumps(schema)

    settings = model.model_validate_json('{"type": "validation", "evaluate": "validate", "interval": 2}')
    hook = settings.build()
    assert isinstance(hook, ValidationHook)
    assert (hook.evaluate, hook.interval, hook.at_last_step, hook.prefix) == ("validate", 2, True, "val")
    trainer = ValTrainer(max_steps=4, hooks=[hook])
    trainer.train()
    assert [s for s, _, _ in trainer.validated_at] == [2, 4]

    # From Python, the settings model takes a callable as well.
    probe = Probe()
    built = model(type="validation", evaluate=probe, interval=1).build()
    assert built.evaluate is probe
    with pytest.raises(pydantic.ValidationError, match="interval"):
        model.model_validate({"type": "validation", "evaluate": "validate", "interval": 0})
    with pytest.raises(pydantic.ValidationError, match="extra"):
        model.model_validate({"type": "validation", "evaluate": "validate", "interval": 1, "every": 2})


def test_results_appear_on_the_console_as_they_are_computed(caplog):
    hook = ValidationHook(lambda t: {"loss": torch.tensor(0.125), "acc": {"top1": 0.5}}, interval=2)
    with caplog.at_level(logging.INFO, logger="trainloop"):
        TinyTrainer(max_steps=3, hooks=[hook]).train()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Validation")]
    assert lines == [
        "Validation at step 2: val/loss 0.125 val/acc/top1 0.5",
        "Validation at step 3: val/loss 0.125 val/acc/top1 0.5",
    ]


def test_unconfigured_logging_shows_results_beside_progress_lines_in_a_fresh_process():
    code = (
        "from tiny_trainer import TinyTrainer\n"
        "from trainloop import ProgressHook, ValidationHook\n"
        "TinyTrainer(max_steps=2, hooks=[ProgressHook(interval=1, bar=False),"
        " ValidationHook(lambda t: {'loss': 0.25}, interval=2)]).train()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support")])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert "Step 2/2: step" in result.stderr
    assert "Validation at step 2: val/loss 0.25" in result.stderr


@pytest.mark.parametrize("run", ["predict", "train", "evaluate"])
def test_a_validation_method_named_after_a_run_is_refused_by_validate(tmp_path, run):
    # Issue 29, defect 11: "evaluate": "predict" passed validate; the run trained, then failed at its first validation.
    from cli_process import Cli

    hooks = [{"type": "validation", "evaluate": run, "interval": 2}]
    (tmp_path / "run.json").write_text(json.dumps({"max_steps": 4, "workspace": "ws", "hooks": hooks}))
    runs = [Cli(command, "run.json", "--trainer", "predict_trainers:PredictTrainer", cwd=tmp_path) for command in ("validate", "run")]
    for command, process in zip(("validate", "run"), runs, strict=True):
        result = process.result()
        assert result.returncode == 2
        assert result.stderr == (
            f"trainloop {command}: error: run.json: hooks[0].evaluate: PredictTrainer.{run}() is a run of the trainer, "
            "not a validation method: name your validation method otherwise (e.g. val_metrics) and point evaluate at it\n"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]
    with pytest.raises(TypeError, match=rf"trainer.{run}\(\) is a run of the trainer"):
        TinyTrainer(max_steps=2, hooks=[ValidationHook(run, interval=1)]).train()


def validation_loader_metrics(trainer):
    """An evaluation over a DataLoader: making its iterator draws a base seed from torch's global generator."""
    from epoch_trainer import Indexed

    losses = [torch.nn.functional.mse_loss(trainer.model(x), y) for x, y, _ in DataLoader(Indexed(8), batch_size=4)]
    return {"loss": torch.stack(losses).mean(), "draw": torch.rand(())}  # a sampled metric draws too


@pytest.mark.parametrize("stop", [5, 6, 8], ids=lambda s: f"stop{s}")
def test_validations_that_draw_random_numbers_leave_a_resumed_run_exact(tmp_path, stop):
    # at_start validates before the first step, and again as the resumed run starts; every 4 steps in between.
    from epoch_trainer import compare

    def hooks():
        return [ValidationHook(validation_loader_metrics, interval=4, at_start=True)]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "settings differ: max_steps"
        unbroken, resumed = compare(tmp_path, {"max_steps": stop}, {"max_steps": 14}, hooks=hooks)
    resumed.assert_same_as(unbroken)
    assert [h.last_step for t in resumed.trainers for h in t.hooks if isinstance(h, ValidationHook)] == [stop, 14]
