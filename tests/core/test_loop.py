"""``trainloop.core.loop.Loop``: the work of each state, the edges' actions, the policies, and the run
state it owns (``RunState``), driven through a real trainer and its machine."""

import pytest
import torch
from helper_hooks import CaptureHook
from tiny_trainer import FlakyTrainer, TinyTrainer, make_data
from torch.utils.data import DataLoader

from trainloop import BaseHook, State
from trainloop.core.run_state import COMPONENTS, RunState
from trainloop.core.training_state import ChangedSettingsWarning


class Probe(BaseHook):
    """Records, at each event, what the loop's run state holds."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, State, int, int, int]] = []  # event, state, step, microsteps, losses

    def _see(self, trainer, event):
        run = trainer.loop.run_state
        runner = trainer.loop.step.runner
        self.seen.append((event, trainer.state, run.step, runner.microsteps, len(run.step_info.loss)))

    def on_before_step(self, trainer):
        self._see(trainer, "before_step")

    def on_after_step(self, trainer):
        self._see(trainer, "after_step")

    def on_enter_retrying(self, trainer):
        self._see(trainer, "retrying")


def test_the_loop_owns_the_run_state_the_trainer_shows():
    hook = CaptureHook()
    trainer = TinyTrainer(max_steps=3, hooks=[hook])
    run = trainer.loop.run_state
    assert isinstance(run, RunState)
    assert (run.step, run.epoch, run.built, run.hooks, run.data) == (0, 0, {}, (), None)
    trainer.train()
    assert run.step == trainer.step == 3
    assert run.hooks == trainer.hooks == (hook,)
    assert set(run.built) == set(COMPONENTS)
    assert trainer.model is run.built["model"]
    assert trainer.optimizer is run.built["optimizer"]
    assert run.step_info is trainer.step_info
    assert len(run.step_info.loss) == 1
    assert run.dispatch["on_after_step"] == (hook.on_after_step,)


def test_begin_step_counts_and_announces_a_step_and_each_microstep_is_one_accumulating_entry():
    probe = Probe()
    trainer = TinyTrainer(max_steps=2, gradient_accumulation_steps=3, hooks=[probe],
                          data=DataLoader(make_data(), batch_size=2))
    trainer.train()
    # on_before_step runs on the begin_step edge: the step counted, no microstep done yet, a fresh
    # step info; on_after_step sees all three microsteps and their losses.
    assert probe.seen == [
        ("before_step", State.ACCUMULATING, 1, 0, 0), ("after_step", State.STEPPING, 1, 3, 3),
        ("before_step", State.ACCUMULATING, 2, 0, 0), ("after_step", State.STEPPING, 2, 3, 3),
    ]


def test_the_accumulating_edge_asks_the_step_whose_runner_reads_the_step_plan():
    trainer = TinyTrainer(max_steps=1, gradient_accumulation_steps=2)
    trainer.train()
    runner = trainer.loop.step.runner
    assert runner.plan.accumulation == 2
    assert runner.microsteps == 2
    assert not trainer.loop.microsteps_remain()
    runner.begin()
    assert trainer.loop.microsteps_remain()
    assert runner.microsteps_remain()


def test_a_skipped_batch_is_not_a_microstep():
    class SkipOdd(TinyTrainer):
        calls = 0

        def forward(self, batch):
            self.calls += 1
            return (None, {}) if self.calls % 2 else super().forward(batch)

    probe = Probe()
    trainer = SkipOdd(max_steps=2, gradient_accumulation_steps=2, hooks=[probe])
    trainer.train()
    assert trainer.calls == 8  # two batches drawn per microstep, two microsteps per step
    assert [s for s in probe.seen if s[0] == "after_step"] == [
        ("after_step", State.STEPPING, 1, 2, 2), ("after_step", State.STEPPING, 2, 2, 2),
    ]
    assert len(trainer.step_info.data_time) == 2  # one entry per counted microstep


def test_redo_step_retries_the_same_step_on_fresh_batches_without_announcing_it():
    probe = Probe()
    # Microstep 3 is the first of step 2 (two per step): its NaN makes step 2 non-finite once.
    trainer = FlakyTrainer(max_steps=3, gradient_accumulation_steps=2, max_non_finite_grad_retries=1,
                           nan_at={3}, hooks=[probe], trace=True)
    trainer.train()
    assert [s[:3] for s in probe.seen] == [
        ("before_step", State.ACCUMULATING, 1), ("after_step", State.STEPPING, 1),
        ("before_step", State.ACCUMULATING, 2), ("retrying", State.RETRYING, 2),
        ("after_step", State.STEPPING, 2),
        ("before_step", State.ACCUMULATING, 3), ("after_step", State.STEPPING, 3),
    ]
    assert trainer.calls == 8
    # The retry dropped the failed attempt's losses and records: the step info is the retry's.
    retried = [s for s in probe.seen if s[0] == "after_step"][1]
    assert retried[3:] == (2, 2)
    edges = [(e.source, e.dest, e.trigger) for e in trainer.trace]
    assert (State.RETRYING, State.ACCUMULATING, "redo_step") in edges
    assert edges.count((State.STEPPING, State.RETRYING, "retry")) == 1


def test_retries_exhausted_end_the_run_with_the_error_recorded_in_the_run_state():
    hook = CaptureHook()
    trainer = FlakyTrainer(max_steps=5, max_non_finite_grad_retries=2, nan_at={"all"}, hooks=[hook])
    with pytest.raises(RuntimeError, match="non-finite gradients at step 1 after 2 retries"):
        trainer.train()
    assert trainer.state is State.EXITING
    assert trainer.loop.run_state.error is trainer.error
    assert isinstance(trainer.error, RuntimeError)
    assert [c[0] for c in hook.calls[-2:]] == ["on_exception", "on_after_train"]
    assert hook.events("on_after_step") == []
    assert trainer.loop.step.retries == 2
    assert trainer.step == 1


def test_a_checkpoint_request_takes_the_checkpointing_state_once_and_an_exit_request_ends_after_its_step():
    class Requests(BaseHook):
        def on_after_step(self, trainer):
            if trainer.step == 2:
                trainer.request_checkpoint()
            if trainer.step == 4:
                trainer.request_exit()

    entered: list[int] = []
    trainer = TinyTrainer(max_steps=10, hooks=[Requests()])
    trainer.on_enter(State.CHECKPOINTING, lambda t: entered.append(t.step))
    trainer.train()
    assert entered == [2]
    assert trainer.step == 4
    assert trainer.result.exit_code == 0


def test_exit_leaves_the_epoch_the_data_ended_in():
    trainer = TinyTrainer(max_steps=20, data=DataLoader(make_data(32), batch_size=8))
    trainer.train()
    run = trainer.loop.run_state
    # Four batches per epoch: step 20 drew the fifth epoch's last batch.
    assert trainer.run_length.epochs_completed == 5
    assert run.epoch == trainer.epoch == run.data.epoch == 4


def test_a_random_state_restored_before_the_data_exists_is_applied_once_it_does():
    source = TinyTrainer(max_steps=2)
    source.train()
    state = source.state_dict()
    draws: list[torch.Tensor] = []

    class Resume(BaseHook):
        def on_enter_restoring(self, trainer):
            trainer.load_state_dict(state)
            assert trainer.loop.run_state.restored_rng is not None  # held: no data iterator yet

        def on_before_step(self, trainer):
            draws.append(torch.rand(1))

    trainer = TinyTrainer(max_steps=3, hooks=[Resume()])
    with pytest.warns(ChangedSettingsWarning, match="max_steps"):
        trainer.train()
    assert trainer.loop.run_state.restored_rng is None
    torch.set_rng_state(state["training_state"]["rng"][0]["torch"])
    assert torch.equal(draws[0], torch.rand(1))  # the saved generator, not one the loader moved


def test_build_components_builds_in_order_and_components_kept_restores_their_absence():
    order: list[str] = []

    class Ordered(TinyTrainer):
        def build_data_loader(self):
            order.append("data_loader")
            return super().build_data_loader()

        def build_model(self):
            order.append("model")
            return super().build_model()

        def build_optimizer(self):
            order.append("optimizer")
            return super().build_optimizer()

        def build_lr_scheduler(self):
            order.append("lr_scheduler")
            return None

        def build_grad_scaler(self):
            order.append("grad_scaler")
            return super().build_grad_scaler()

    trainer = Ordered(max_steps=1)
    with trainer.loop.components_kept():
        trainer.loop.build_components(lr_scheduler=False)
        assert order == ["data_loader", "model", "optimizer", "grad_scaler"]
        assert isinstance(trainer.model, torch.nn.Module)
    assert trainer.loop.run_state.built == {}
    with pytest.raises(AttributeError, match="not built yet"):
        trainer.model  # noqa: B018
    order.clear()
    trainer.train()
    assert order == ["data_loader", "model", "optimizer", "lr_scheduler", "grad_scaler"]
