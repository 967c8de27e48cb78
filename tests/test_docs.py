"""docs/ stays true to the code: generated parts are current, and the table of hook methods
matches where a real run calls them."""

import subprocess
import sys
from pathlib import Path

from tiny_trainer import CaptureHook, TinyTrainer

from trainloop.hooks.base import HOOK_EVENTS

ROOT = Path(__file__).resolve().parents[1]


def test_generated_docs_are_current():
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "generate.py"), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_hook_methods_run_in_the_states_the_docs_say():
    hook = CaptureHook()
    TinyTrainer(max_steps=3, gradient_accumulation_steps=2, hooks=[hook]).train()
    seen = {event: {state for name, state, _ in hook.calls if name == event} for event in HOOK_EVENTS}
    for event in ("on_before_train", "on_before_step", "on_after_train"):
        assert seen[event] == {s.value for s in HOOK_EVENTS[event]}
    # The optimizer-step methods run on the last microstep, which is `accumulating` here.
    for event in ("on_before_optimizer_step", "on_after_step"):
        assert seen[event] and seen[event] <= {s.value for s in HOOK_EVENTS[event]}
