"""BaseHook: the one hook mechanism: known method names only, dispatch to the hooks that care."""

import pytest
from pydantic import ValidationError
from tiny_trainer import TinyTrainer

from trainloop import BaseHook, CheckpointingHook, State
from trainloop.hook_machinery.dispatch import HOOK_METHODS, hook_dispatch


@pytest.mark.parametrize(
    ("method", "suggestion"),
    [
        ("on_enter_checkpoiting", "did you mean on_enter_checkpointing?"),
        ("on_after_steps", "did you mean on_after_step?"),
        ("on_train_end", "did you mean on_after_train?"),
        ("on_qqq", "hook methods are on_after_step, "),
    ],
)
def test_a_misspelt_hook_method_fails_when_hooks_are_built_before_any_step(tmp_path, method, suggestion):
    Typo = type("Typo", (BaseHook,), {method: lambda self, trainer: None})
    trainer = TinyTrainer(max_steps=2, hooks=[Typo()], workspace=tmp_path / "ws")
    with pytest.raises(TypeError, match=f"Typo.{method} is not a hook method, so it would never be called; {suggestion}"):
        trainer.train()
    assert trainer.step == 0
    assert trainer.state is State.EXITING


def test_attributes_named_on_something_that_are_not_methods_are_fine():
    class Configured(BaseHook):
        def __init__(self):
            self.on_save_error = "raise"  # a parameter, not a method

    TinyTrainer(max_steps=1, hooks=[Configured()]).train()


def test_every_hook_method_is_an_event_or_a_state_entry():
    assert {"on_before_train", "on_exception", "on_enter_checkpointing", "on_enter_accumulating"} <= HOOK_METHODS
    assert not [m for m in HOOK_METHODS if m.startswith("on_exit_")]


def test_dispatch_lists_only_the_hooks_that_override_a_method():
    class Steps(BaseHook):
        def on_after_step(self, trainer):
            pass

    a, b = Steps(), BaseHook()
    dispatch = hook_dispatch([a, b])
    assert dispatch["on_after_step"] == (a.on_after_step,)
    assert dispatch["on_before_step"] == ()
    assert dispatch["on_exception"] == ()


def test_a_misspelt_keyword_of_a_hook_says_what_was_meant_once():
    with pytest.raises(ValidationError) as info:
        CheckpointingHook(intervl=3)
    assert [e["msg"] for e in info.value.errors()] == ["unknown argument 'intervl'; did you mean 'interval'?"]
    with pytest.raises(ValidationError, match=r"unknown argument 'bogus'; its arguments are interval, keep_previous"):
        CheckpointingHook(interval=3, bogus=1)
    with pytest.raises(ValidationError, match="valid integer"):  # other errors keep pydantic's words
        CheckpointingHook(interval="x")
