"""One checkpointed step stays within its modules: the walk of benchmarks/step_walk.py, held to its bounds.

docs/architecture.md gives the figures; a change that makes one step cross more modules (or call back
into one it just left) more often fails here, and the page says why it matters.
"""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODULES = 17  # modules one checkpointed step touches, at most
PAIRS = 26  # distinct module-to-module call pairs, at most
DOUBLED_BACK = 0  # pairs A -> B whose B calls back into A, at most
CHECKPOINT_SIDE = 4  # the hook, the manager and what it writes through


def walk():
    spec = importlib.util.spec_from_file_location("step_walk", ROOT / "benchmarks" / "step_walk.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["step_walk"] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module.walk_one_step()


def test_one_checkpointed_step_stays_within_its_bounds():
    seen = walk()
    assert "hooks.checkpointing" in seen.modules  # the walk saw the save
    assert "checkpoint.manager" in seen.modules
    assert len(seen.modules) <= MODULES, sorted(seen.modules)
    assert len(seen.pairs) <= PAIRS, sorted(seen.pairs)
    assert len(seen.doubled_back) <= DOUBLED_BACK, sorted(seen.doubled_back)
    # The schedule calls the hook; the hook never asks the loop to call it back.
    assert ("hooks.checkpointing", "core.loop") not in seen.pairs
    assert ("hooks.checkpointing", "core.run_state") not in seen.pairs
    # The step calls the hooks itself (on_before_optimizer_step), not back through the loop; the training
    # state takes the built components from the run state, not back from the trainer that asked for it.
    assert ("core.step", "core.loop") not in seen.pairs
    assert ("core.training_state", "trainer") not in seen.pairs
    # A single process settles its requests without the ranks' agreement.
    assert "distributed.agreement" not in seen.modules
    # The save goes one way: hook -> manager -> (storage, manifest), nothing calls back.
    side = sorted(m for m in seen.modules if m == "hooks.checkpointing" or m.startswith("checkpoint."))
    assert len(side) <= CHECKPOINT_SIDE, side
    assert not [pair for pair in seen.doubled_back if any(m in side for m in pair)]
