"""Exact resume: a run stopped and resumed ends bitwise identical to one that never stopped."""

import warnings

import pytest
import torch
from helper_hooks import ExitAt
from tiny_trainer import TinyTrainer, make_data
from torch import nn
from torch.utils.data import DataLoader

from trainloop import BaseTrainer, State
from trainloop.core.data import InexactResumeWarning
from trainloop.core.training_state import ChangedGlobalBatchError, ChangedSettingsWarning, global_batch_refusal
from trainloop.hooks import CheckpointingHook

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


class DropoutTrainer(TinyTrainer):
    """Dropout (consumes torch's RNG every step) over a shuffling StatefulDataLoader of 5 batches
    per epoch, so stops fall mid-epoch."""

    def build_data_loader(self):
        # No generator= argument: shuffling then draws from torch's global generator, which the
        # checkpoint restores (StatefulDataLoader does not save a generator given to it).
        return StatefulDataLoader(make_data(40), batch_size=8, shuffle=True)

    def build_model(self):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 1))



def run(max_steps, stop_at=None, resume_from=None, **kwargs):
    torch.manual_seed(3)  # the shuffle's seed, as a run's seed setting would
    trainer = DropoutTrainer(max_steps=max_steps, hooks=[ExitAt(stop_at)] if stop_at else [], **kwargs)
    if resume_from is not None:
        trainer.on_enter(State.RESTORING, lambda t: t.load_state_dict(resume_from))
    trainer.train()
    return trainer


@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("stop_at", [3, 7, 10])  # mid-epoch, mid-epoch, at an epoch's end
def test_stopped_and_resumed_equals_uninterrupted(stop_at, accumulation):
    straight = run(17, gradient_accumulation_steps=accumulation)
    first = run(17, stop_at=stop_at, gradient_accumulation_steps=accumulation)
    assert first.step == stop_at
    saved = first.state_dict()
    resumed = run(17, resume_from=saved, gradient_accumulation_steps=accumulation)
    assert resumed.step == 17
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a, b)


def test_checkpoint_holds_per_rank_rng_and_loader_state_and_settings_json():
    trainer = run(2)
    state = trainer.state_dict()["training_state"]
    assert len(state["rng"]) == 1
    assert {"python", "torch", "numpy"} <= set(state["rng"][0])
    assert isinstance(state["data_loader"][0], dict)
    assert '"max_steps":2' in state["settings"]


def test_a_plain_dataloader_saves_where_its_sampler_is_mid_epoch_and_nothing_at_an_epoch_end():
    trainer = TinyTrainer(max_steps=2)  # 8 batches per epoch
    trainer.train()
    (position,) = trainer.state_dict()["training_state"]["data_loader"]
    assert position["trainloop_sampler_position"]["drawn"] == 2
    trainer = TinyTrainer(max_steps=8)
    trainer.train()
    state = trainer.state_dict()["training_state"]
    assert state["data_loader"] == [None]
    assert state["epoch"] == 1  # the next epoch begins afresh


def test_resuming_with_other_settings_warns_naming_them():
    saved = run(3).state_dict()
    with pytest.warns(UserWarning, match="differ from the checkpoint's: grad_clip, max_steps"):
        run(4, resume_from=saved, grad_clip=1.0)


def test_a_changed_optimizer_declaration_on_resume_says_it_does_not_apply():
    class Declared(DropoutTrainer):
        build_optimizer = BaseTrainer.build_optimizer  # the declared optimizer

    def declared_run(lr, resume_from=None):
        trainer = Declared(max_steps=3 if resume_from is None else 4, optimizer={"name": "SGD", "lr": lr})
        if resume_from is not None:
            trainer.on_enter(State.RESTORING, lambda t: t.load_state_dict(resume_from))
        trainer.train()
        return trainer

    saved = declared_run(0.1).state_dict()
    with pytest.warns(UserWarning, match="changed optimizer settings take effect only in a fresh run"):
        resumed = declared_run(0.5, resume_from=saved)
    assert resumed.optimizer.param_groups[0]["lr"] == 0.1  # the checkpoint's, as the warning says


def test_changed_optimizers_on_resume_say_which_optimizer_and_field_take_effect_only_in_a_fresh_run(tmp_path):
    class TwoParts(DropoutTrainer):
        build_optimizer = BaseTrainer.build_optimizer  # the declared optimizers

        def forward(self, batch, optimizer):
            return super().forward(batch)

    def declared(head_lr, max_steps):
        modules = {"body": "0", "head": "3"}  # the first and last Linear of the Sequential
        optimizers = {name: {"name": "SGD", "lr": 0.1, "module": module} for name, module in modules.items()}
        optimizers["head"]["lr"] = head_lr
        trainer = TwoParts(max_steps=max_steps, optimizers=optimizers, workspace=tmp_path,
                           hooks=[CheckpointingHook(interval=3, exit_signals=[])])
        trainer.train()
        return trainer

    declared(0.1, 3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = declared(0.5, 4)
    said = [str(w.message) for w in caught if issubclass(w.category, ChangedSettingsWarning)]
    assert (
        "optimizers.head.lr 0.1 -> 0.5: the checkpoint's optimizer 'head' state is restored, its learning rates and "
        "other param-group values included, so the changed optimizer settings take effect only in a fresh run"
    ) in said
    assert not any("'body'" in line for line in said)  # unchanged: not said
    assert resumed.optimizers["head"].param_groups[0]["lr"] == 0.1  # the checkpoint's, as the warning says


def shuffled(batch_size):
    return DataLoader(make_data(64), batch_size=batch_size, shuffle=True)


def plain_run(max_steps, batch_size=8, stop_at=None, resume_from=None, **kwargs):
    trainer = TinyTrainer(max_steps=max_steps, seed=4, data=shuffled(batch_size),
                          hooks=[ExitAt(stop_at)] if stop_at else [], **kwargs)
    if resume_from is not None:
        trainer.on_enter(State.RESTORING, lambda t: t.load_state_dict(resume_from))
    trainer.train()
    return trainer


def test_a_checkpoint_records_the_global_batch():
    state = plain_run(2, gradient_accumulation_steps=3).state_dict()["training_state"]
    assert state["global_batch"] == {"ranks": 1, "batch_size": 8, "accumulation": 3}


def test_resuming_with_another_batch_size_and_the_same_global_batch_goes_on_where_it_stopped():
    # 8 batches of 8 per epoch; stopped mid-epoch 0, resumed with batches of 4 accumulated twice.
    unbroken = plain_run(12)
    saved = plain_run(12, stop_at=3).state_dict()
    resumed = plain_run(12, batch_size=4, resume_from=saved, gradient_accumulation_steps=2)
    assert resumed.step == 12
    for a, b in zip(unbroken.model.parameters(), resumed.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("batch_size", "accumulation", "fix"), [
    (4, 2, "set gradient_accumulation_steps=3 or build the data loader with batch_size=6"),
    (6, 1, "set gradient_accumulation_steps=2 or build the data loader with batch_size=12"),
    (8, 2, "build the data loader with batch_size=6"),
    (5, 5, "choose a batch size and gradient_accumulation_steps whose product is 12"),
])
def test_resuming_with_another_global_batch_is_refused_before_the_first_step(batch_size, accumulation, fix):
    saved = plain_run(2, gradient_accumulation_steps=2, batch_size=6).state_dict()
    steps = []
    trainer = TinyTrainer(max_steps=4, data=shuffled(batch_size), gradient_accumulation_steps=accumulation)
    trainer.on_enter(State.RESTORING, lambda t: t.load_state_dict(saved))
    trainer.on_enter(State.ACCUMULATING, lambda t: steps.append(t.step))
    with pytest.raises(ChangedGlobalBatchError) as error:
        trainer.train()
    assert str(error.value) == (
        f"the checkpoint's global batch is 12 (1 rank x batch size 6 x gradient_accumulation_steps 2) and this run's is "
        f"{batch_size * accumulation} (1 rank x batch size {batch_size} x gradient_accumulation_steps {accumulation}): "
        f"a resume must keep the global batch, so on 1 rank {fix}, or start fresh (another workspace, or "
        "CheckpointingHook(load=None))"
    )
    assert steps == []


def test_a_stateful_loader_resumed_on_another_number_of_ranks_says_once_that_its_epoch_starts_over():
    state = run(3).state_dict()  # 3 of the 5 batches of epoch 0, on one rank
    saved = state["training_state"]
    # As two ranks would have saved it: every per-rank entry twice, the global batch twice as large.
    saved["rng"], saved["data_loader"] = saved["rng"] * 2, saved["data_loader"] * 2
    saved["global_batch"] = {**saved["global_batch"], "ranks": 2}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = run(4, resume_from=state, gradient_accumulation_steps=2)
    inexact = [str(w.message) for w in caught if issubclass(w.category, InexactResumeWarning)]
    assert inexact == [
        "resuming on 1 rank from a checkpoint of 2: the data loader's saved state (StatefulDataLoader's own) is per "
        "rank, so it is not restored and epoch 0 starts over from its beginning; a DataLoader over a map-style dataset "
        "with a DistributedSampler resumes exactly on any number of ranks"
    ]
    assert resumed.step == 4


def test_a_global_batch_the_new_ranks_cannot_split_says_so():
    then = {"ranks": 2, "batch_size": 6, "accumulation": 1}
    assert global_batch_refusal(then, {"ranks": 5, "batch_size": 6, "accumulation": 1}) == (
        "the checkpoint's global batch is 12 (2 ranks x batch size 6 x gradient_accumulation_steps 1) and this run's "
        "is 30 (5 ranks x batch size 6 x gradient_accumulation_steps 1): a resume must keep the global batch, which 5 "
        "ranks cannot split evenly: resume on a number of ranks that divides 12, or start fresh (another workspace, or "
        "CheckpointingHook(load=None))"
    )
    assert global_batch_refusal(then, {"ranks": 4, "batch_size": 3, "accumulation": 1}) is None
    assert global_batch_refusal(then, {"ranks": 4, "batch_size": None, "accumulation": 1}) is None
