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
        if state is not None:
            assert seen[event] == {state.value}, event
