"""The run state is the loop's: the trainer shows it read-only, hooks read it and request, and
``step_info`` reads and takes records like a dict while staying typed."""

import ast
import re
from pathlib import Path

import pytest
import torch
from tiny_trainer import TinyTrainer

from trainloop import BaseHook, State
from trainloop.step_info import StepInfo

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("name", "value", "instead"),
    [
        ("step", 5, "load_state_dict()"),
        ("epoch", 1, "load_state_dict()"),
        ("step_info", StepInfo(), "trainer.step_info['name'] = value"),
        ("hooks", [], "build_hooks()"),
        ("error", None, "raise the error"),
    ],
)
def test_assigning_run_state_says_what_to_call_instead(name, value, instead):
    trainer = TinyTrainer(max_steps=1)
    with pytest.raises(AttributeError, match=rf"trainer\.{name} is the loop's and read-only: .*{re.escape(instead)}"):
        setattr(trainer, name, value)


def test_a_hook_that_assigns_the_step_ends_the_run_with_that_message():
    class Cheat(BaseHook):
        def on_after_step(self, trainer):
            trainer.step = 100

    trainer = TinyTrainer(max_steps=3, hooks=[Cheat()])
    with pytest.raises(AttributeError, match="request_exit"):
        trainer.train()
    assert trainer.step == 1
    assert trainer.state is State.EXITING


def test_components_may_be_assigned_before_a_run_but_not_during_it():
    trainer = TinyTrainer(max_steps=2)
    assert not hasattr(trainer, "model")
    with pytest.raises(AttributeError, match="not built yet: train\\(\\) builds it with build_model\\(\\)"):
        trainer.model  # noqa: B018
    model = trainer.build_model()
    trainer.model = model  # before train(): use forward() outside a run
    assert trainer.model is model
    x, y = torch.zeros(2, 4), torch.zeros(2, 1)
    assert trainer.forward((x, y))[0].ndim == 0

    replaced: list[str] = []

    class Swap(BaseHook):
        def on_after_step(self, trainer):
            for name in ("model", "optimizer", "lr_scheduler", "grad_scaler", "data_loader"):
                try:
                    setattr(trainer, name, None)
                except AttributeError as error:
                    replaced.append(str(error))

    trainer = TinyTrainer(max_steps=1, hooks=[Swap()])
    trainer.train()
    assert len(replaced) == 5
    assert replaced[0] == (
        "trainer.model was built in 'building' and is not replaced during a run (state 'stepping'): "
        "change it in place, or restore a state with trainer.load_state_dict()"
    )
    assert trainer.model is not None
    assert trainer.lr_scheduler is None


def test_a_component_assigned_before_base_init_is_kept():
    class Prebuilt(TinyTrainer):
        def __init__(self, **kwargs):
            self.model = torch.nn.Linear(4, 1)
            super().__init__(**kwargs)

        def build_model(self):
            return self.model

    trainer = Prebuilt(max_steps=1)
    model = trainer.model
    trainer.train()
    assert trainer.model is model


def test_step_info_reads_and_takes_records_like_a_dict():
    seen = {}

    class Memory(BaseHook):  # as CudaMaxMemoryHook writes it
        def on_after_step(self, trainer):
            trainer.step_info["max_memory"] = 1.5
            trainer.step_info["tokens"] = 128

    class Reader(BaseHook):  # as the stats hooks read it
        def on_after_step(self, trainer):
            info = trainer.step_info
            seen["loss"] = torch.stack(info["loss"]).mean()
            seen["retries"] = info["non_finite_grad_retries"]
            seen["has_memory"] = "max_memory" in info
            seen["memory"] = info["max_memory"]
            seen["has_grad_norm"] = "grad_norm" in info  # no grad_clip: absent
            seen["tokens"] = info["tokens"]
            seen["extras"] = info.extras
            seen["get"] = info.get("grad_norm", "none")

    trainer = TinyTrainer(max_steps=1, gradient_accumulation_steps=2, hooks=[Memory(), Reader()])
    trainer.train()
    assert seen["loss"].ndim == 0
    assert seen["retries"] == 0
    assert seen["has_memory"]
    assert seen["memory"] == 1.5
    assert not seen["has_grad_norm"]
    assert seen["get"] == "none"
    assert seen["tokens"] == 128
    assert seen["extras"] == {"max_memory": 1.5, "tokens": 128}  # a hook's additions are its records
    with pytest.raises(KeyError):
        trainer.step_info["grad_norm"]
    with pytest.raises(KeyError):
        trainer.step_info["no_such_record"]


# The modules below the trainer: hooks and what they read are typed against the run's view
# (trainloop.core.run_state), so none of them imports the trainer, not even for types.
LOW = [
    "trainloop/core", "trainloop/hooks", "trainloop/machine", "trainloop/checkpoint", "trainloop/settings",
    "trainloop/distributed", "trainloop/predict", "trainloop/step_info.py", "trainloop/loss.py", "trainloop/utils.py",
]


def test_no_module_below_the_trainer_imports_it():
    offenders = []
    for entry in LOW:
        path = ROOT / entry
        for file in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
                names = (
                    [node.module or ""] if isinstance(node, ast.ImportFrom)
                    else [a.name for a in node.names] if isinstance(node, ast.Import) else []
                )
                if any(n == "trainloop.trainer" for n in names):
                    offenders.append(str(file.relative_to(ROOT)))
    assert offenders == []


def test_epoch_reads_the_epoch_the_run_draws_from_while_it_runs():
    # A Lightning user reads trainer.epoch in a hook as the epoch in progress (0-based).
    seen: list[tuple[int, int]] = []

    class EpochRecorder(BaseHook):
        def on_after_step(self, trainer):
            seen.append((trainer.step, trainer.epoch))

    trainer = TinyTrainer(max_epochs=2, hooks=[EpochRecorder()])
    assert trainer.epoch == 0  # before the run: the epoch it would start in
    result = trainer.train()
    assert seen[0] == (1, 0)
    assert sorted({epoch for _, epoch in seen}) == [0, 1]  # both epochs seen while running
    assert seen[-1][1] == trainer.epoch == 1  # 0-based; the result counts completed epochs
    assert result.epoch == 2
