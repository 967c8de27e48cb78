"""EmaHook: the average matches a hand-computed EMA and survives a checkpoint round trip."""

from __future__ import annotations

import logging

import pytest
import torch
from helper_hooks import LoadHook
from pydantic import ValidationError
from tiny_trainer import TinyTrainer
from torch import nn
from torch.optim.swa_utils import AveragedModel

from trainloop import BaseHook
from trainloop.hook_machinery.registry import HOOK_TYPES, hook_settings_model
from trainloop.hooks.ema import EmaHook


class BatchNormTrainer(TinyTrainer):
    """TinyTrainer with a batch-norm layer, so the model has buffers to average too."""

    def build_model(self):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


class SnapshotHook(BaseHook):
    """Copies the model's floating-point weights and buffers after every step."""

    def __init__(self) -> None:
        self.snapshots: list[dict[str, torch.Tensor]] = []

    def on_after_step(self, trainer):
        self.snapshots.append(
            {
                k: v.detach().clone()
                for k, v in trainer.unwrapped_model.state_dict().items()
                if v.is_floating_point()
            }
        )


def hand_ema(snapshots, decay, start=None):
    """EMA over snapshots; the first snapshot is copied unless an average to continue is given."""
    ema = None if start is None else {k: v.clone() for k, v in start.items()}
    for snap in snapshots:
        if ema is None:
            ema = {k: v.clone() for k, v in snap.items()}
        else:
            ema = {k: decay * ema[k] + (1 - decay) * snap[k] for k in ema}
    return ema


def ema_floats(hook: EmaHook) -> dict[str, torch.Tensor]:
    return {k: v for k, v in hook.ema_model.module.state_dict().items() if v.is_floating_point()}


def save_and_load(state_dict, path):
    """Round-trip a state dict through a real file, as a checkpoint does."""
    torch.save(state_dict, path)
    return torch.load(path, weights_only=True)


def test_average_of_weights_and_buffers_matches_hand_computed_ema():
    ema, snap = EmaHook(decay=0.6), SnapshotHook()
    trainer = BatchNormTrainer(max_steps=5, hooks=[snap, ema])
    trainer.train()

    assert isinstance(ema.ema_model, AveragedModel)
    assert int(ema.ema_model.n_averaged) == 5
    expected = hand_ema(snap.snapshots, 0.6)
    actual = ema_floats(ema)
    assert set(actual) == set(expected)
    assert "1.running_mean" in actual  # buffers are averaged as well as parameters
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-5, atol=1e-6)
    # The average lags the weights: it is not simply the last model.
    assert not torch.allclose(actual["0.weight"], snap.snapshots[-1]["0.weight"])
    # The EMA copy is separate from the model and not trained.
    assert all(not p.requires_grad for p in ema.ema_model.parameters())
    assert ema.ema_model.module is not trainer.unwrapped_model


def test_state_survives_a_checkpoint_round_trip(tmp_path):
    first = EmaHook(decay=0.7)
    trainer = TinyTrainer(max_steps=3, hooks=[first])
    trainer.train()
    state = trainer.state_dict()
    assert set(state[first.name]) >= {"n_averaged", "module.0.weight"}
    state = save_and_load(state, tmp_path / "ckpt.pt")
    saved_average = ema_floats(first)

    second, snap = EmaHook(decay=0.7), SnapshotHook()
    resumed = TinyTrainer(max_steps=6, hooks=[LoadHook(state), snap, second])
    resumed.train()

    assert resumed.step == 6
    assert int(second.ema_model.n_averaged) == 6
    # Steps 4-6 continue the saved average; had the count been lost, step 4 would copy weights.
    expected = hand_ema(snap.snapshots, 0.7, start=saved_average)
    for key, value in ema_floats(second).items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6)


def test_resume_without_saved_average_starts_from_restored_weights(tmp_path, caplog):
    trainer = TinyTrainer(max_steps=2)
    trainer.train()
    state = save_and_load(trainer.state_dict(), tmp_path / "ckpt.pt")

    ema, snap = EmaHook(decay=0.5), SnapshotHook()
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        TinyTrainer(max_steps=4, hooks=[LoadHook(state), snap, ema]).train()

    assert any("no EMA state under 'ema_hook'" in r.getMessage() for r in caplog.records)
    assert int(ema.ema_model.n_averaged) == 2
    expected = hand_ema(snap.snapshots, 0.5)  # fresh: step 3 copied, step 4 averaged
    for key, value in ema_floats(ema).items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6)


def test_two_ema_hooks_keep_separate_state():
    slow, fast = EmaHook(decay=0.9), EmaHook(decay=0.1)
    fast.name = "ema_fast"
    trainer = TinyTrainer(max_steps=3, hooks=[slow, fast])
    trainer.train()
    state = trainer.state_dict()

    assert (slow.name, fast.name) == ("ema_hook", "ema_fast")
    torch.testing.assert_close(state["ema_hook"]["module.0.weight"], slow.ema_model.module[0].weight)
    torch.testing.assert_close(state["ema_fast"]["module.0.weight"], fast.ema_model.module[0].weight)
    assert not torch.allclose(state["ema_hook"]["module.0.weight"], state["ema_fast"]["module.0.weight"])


def test_state_dict_has_the_entry_while_restoring():
    # A loader that fills a template in place (torch.distributed.checkpoint) asks for the
    # trainer's state dict before training starts; the EMA entry must already be there.
    class Template(BaseHook):
        def on_enter_restoring(self, trainer):
            state = trainer.state_dict()
            self.ema = {k: v.clone() for k, v in state["ema_hook"].items()}
            self.model = {k: v.clone() for k, v in state["model"].items()}

    hook, template = EmaHook(), Template()
    assert hook.ema_model is None
    TinyTrainer(max_steps=1, hooks=[hook, template]).train()
    assert int(template.ema["n_averaged"]) == 0
    torch.testing.assert_close(template.ema["module.0.weight"], template.model["0.weight"])
    assert int(hook.ema_model.n_averaged) == 1  # the same average went on to be updated


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.5, 1.5, "0.9", True, None])
def test_invalid_decay_is_rejected(decay):
    with pytest.raises(ValidationError, match="decay"):
        EmaHook(decay=decay)


def test_declarable_in_settings():
    assert HOOK_TYPES["ema"] is EmaHook
    model = hook_settings_model(EmaHook)
    hook = model.model_validate({"type": "ema", "decay": 0.99}).build()
    assert isinstance(hook, EmaHook)
    assert hook.decay == 0.99
    assert model.model_validate({"type": "ema"}).build().decay == 0.9999
    with pytest.raises(ValidationError, match="decay"):
        model.model_validate({"type": "ema", "decay": 1})
    with pytest.raises(ValidationError, match="rate"):
        model.model_validate({"type": "ema", "rate": 0.5})
