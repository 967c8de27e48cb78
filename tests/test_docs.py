"""docs/ stays true to the code: generated parts are current, and the table of hook methods
matches where a real run calls them."""

import subprocess
import sys
from pathlib import Path

import pytest

from tiny_trainer import CaptureHook, TinyTrainer

from trainloop.hooks.base import HOOK_EVENTS

ROOT = Path(__file__).resolve().parents[1]


def test_generated_docs_are_current():
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "generate.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("accumulation", [1, 2, 3])
def test_hook_methods_run_in_the_one_state_the_docs_say(accumulation):
    hook = CaptureHook()
    TinyTrainer(max_steps=3, gradient_accumulation_steps=accumulation, hooks=[hook]).train()
    seen = {event: {state for name, state, _ in hook.calls if name == event} for event in HOOK_EVENTS}
    for event, state in HOOK_EVENTS.items():
        if state is not None and event != "on_exception":
            assert seen[event] == {state.value}, event


def test_on_exception_runs_in_its_state_before_on_after_train():
    hook = CaptureHook()

    class Failing(TinyTrainer):
        def forward(self, batch):
            if self.step == 2:
                raise ValueError("boom")
            return super().forward(batch)

    with pytest.raises(ValueError, match="boom"):
        Failing(max_steps=3, hooks=[hook]).train()
    assert hook.calls[-2:] == [("on_exception", HOOK_EVENTS["on_exception"].value, 2), ("on_after_train", "exiting", 2)]
    assert isinstance(hook.error, ValueError)
