"""DeepSpeed's config as a user meets it: checked against what DeepSpeed reads, refused in one line before step 1.

The engine cases (offload, the warnings a run prints) run in tests/support/deepspeed_worker.py's one launch and
are asserted in tests/distributed/test_deepspeed.py; these run in this process or through the command line.
"""

import importlib.util

import pytest
import torch

from trainloop.core.result import RefusedRunError

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAS_DEEPSPEED, reason="DeepSpeed is not installed (trainloop[deepspeed])")
ZERO3 = {"zero_optimization": {"stage": 3}}
OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def _trainer(**settings):
    from tiny_trainer import TinyTrainer

    return TinyTrainer(**{"max_steps": 2, "device": "cpu", "deepspeed": ZERO3, **settings})


@needs_deepspeed
def test_a_torch_optimizer_under_offload_is_one_line_saying_what_deepspeed_wants(tmp_path):
    trainer = _trainer(deepspeed=OFFLOAD, workspace=tmp_path / "ws")
    with pytest.raises(RefusedRunError) as error:
        trainer.train()
    assert str(error.value) == (
        "TinyTrainer.build_optimizer() returned SGD, but deepspeed's offload_optimizer (device 'cpu') steps "
        "DeepSpeed's CPU optimizer: return deepspeed.ops.adam.DeepSpeedCPUAdam, or set "
        '"zero_force_ds_cpu_optimizer": false to step this one on the CPU'
    )
    assert trainer.step == 0
    assert not (tmp_path / "ws").exists()


def test_several_optimizers_are_refused_before_forward_is_checked_against_them():
    # forward(batch) takes no optimizer's name: the DeepSpeed refusal is what the user must fix first.
    trainer = _trainer()
    trainer.build_optimizer = lambda: {  # type: ignore[method-assign]
        "a": torch.optim.SGD(trainer.model.parameters(), lr=0.1),
        "b": torch.optim.SGD(trainer.model.parameters(), lr=0.1),
    }
    with pytest.raises(RefusedRunError) as error:
        trainer.train()
    assert str(error.value) == (
        "TinyTrainer.build_optimizer() returned several optimizers (a, b), but deepspeed drives one: "
        "return one optimizer"
    )
