"""StatsHook: aggregation over microsteps, intervals and ranks, and its cost between emissions."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helper_hooks import CaptureHook, ExitAt, LogCapture, MemoryHook
from pydantic import ValidationError
from tiny_trainer import TinyTrainer, make_data
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from trainloop import BaseHook
from trainloop.distributed import destroy
from trainloop.hook_machinery.registry import HOOK_TYPES, hook_settings_model
from trainloop.hooks.logging_hook import LoggingHook
from trainloop.hooks.stats import StatsHook, TrainingStats

# -- helpers ------------------------------------------------------------------------------------


class Recorder(StatsHook):
    """A StatsHook that keeps every emission, with the trainer's step at that moment."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.emitted: list[tuple[int, TrainingStats]] = []

    def emit(self, trainer, stats):
        self.emitted.append((trainer.step, stats))


class RecordsTrainer(TinyTrainer):
    """Returns tensor, nested and plain-number records; ``odd`` only on odd forward calls."""

    def __init__(self, *args, extra: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0
        self.extra = extra or {}

    def forward(self, batch):
        self.calls += 1
        loss, records = super().forward(batch)
        records = {**records, "nested": {"call": float(self.calls)}, **self.extra}
        if self.calls % 2:
            records["odd"] = torch.tensor(1.0)
        return loss, records


class NanOnceTrainer(TinyTrainer):
    """Its ``nan_call``-th forward returns a NaN loss (so NaN gradients), once."""

    def __init__(self, *args, nan_call: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0
        self.nan_call = nan_call

    def forward(self, batch):
        self.calls += 1
        loss, records = super().forward(batch)
        if self.calls == self.nan_call:
            loss = loss * float("nan")
        return loss, records


class GroupsTrainer(TinyTrainer):
    """Two param groups (the first named ``groups[0]`` if given) and a real StepLR."""

    def __init__(self, *args, names: tuple = ("body", None), **kwargs):
        super().__init__(*args, **kwargs)
        self.names = names

    def build_optimizer(self):
        first, second = self.model[0], self.model[2]
        groups = [{"params": first.parameters(), "lr": 0.1}, {"params": second.parameters(), "lr": 0.05}]
        for group, name in zip(groups, self.names):
            if name is not None:
                group["name"] = name
        return torch.optim.SGD(groups)

    def build_lr_scheduler(self):
        return torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=2, gamma=0.5)


def mean(values):
    values = list(values)
    return sum(values) / len(values)


# -- aggregation --------------------------------------------------------------------------------


def test_means_over_microsteps_and_interval():
    stats, capture = StatsHook(interval=3), CaptureHook()
    trainer = TinyTrainer(max_steps=6, gradient_accumulation_steps=2, hooks=[stats, capture])
    trainer.train()

    infos = capture.step_infos
    for window, emit_step in ((infos[0:3], 3), (infos[3:6], 6)):
        published = window[-1].get("stats")  # StatsHook publishes in step_info on emitting steps
        losses = [loss.item() for info in window for loss in info.loss]
        assert len(losses) == 6  # 3 steps x 2 microsteps
        assert published.step == emit_step
        assert published.steps == 3
        assert published.loss == pytest.approx(mean(losses), rel=1e-6)
        assert published.records == {"mse": pytest.approx(mean(losses), rel=1e-6)}
        assert published.step_time == pytest.approx(mean(info.step_time for info in window))
        assert published.data_time == pytest.approx(mean(sum(info.data_time) for info in window))
        assert published.non_finite_grad_retries == 0
        assert published.grad_norm is None
        assert published.max_memory is None
        assert published.lrs == {"group_0": 0.05}
    assert [(info.get("stats") is not None) for info in infos] == [False, False, True, False, False, True]
    assert stats.latest is infos[5].get("stats")


def test_records_averaged_key_by_key_over_microsteps():
    rec = Recorder(interval=2)
    trainer = RecordsTrainer(max_steps=4, gradient_accumulation_steps=2, hooks=[rec])
    trainer.train()

    # forward calls 1-4 make the first window, 5-8 the second; "odd" exists on odd calls only.
    (_, first), (_, second) = rec.emitted
    assert first.records["nested"] == {"call": 2.5}
    assert second.records["nested"] == {"call": 6.5}
    assert first.records["odd"] == 1.0
    assert second.records["odd"] == 1.0
    assert first.records["mse"] == pytest.approx(first.loss, rel=1e-6)


def test_lr_is_read_before_the_scheduler_steps():
    capture = CaptureHook()
    stats = StatsHook(interval=1)
    trainer = GroupsTrainer(max_steps=4, hooks=[stats, capture])
    trainer.train()

    # StepLR(step_size=2, gamma=0.5): steps 1-2 use the initial lrs, steps 3-4 half of them.
    lrs = [info.get("stats").lrs for info in capture.step_infos]
    assert lrs == [{"body": 0.1 * f, "group_1": 0.05 * f} for f in (1.0, 1.0, 0.5, 0.5)]
    # ...whereas after step 4 the optimizer already holds the lr of a step 5.
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


def test_param_group_names_stay_unique():
    rec = Recorder(interval=1)
    GroupsTrainer(max_steps=1, names=("head", "head"), hooks=[rec]).train()
    assert list(rec.emitted[0][1].lrs) == ["head", "head_1"]


def test_tensor_lr_is_the_value_of_its_step():
    class TensorLrTrainer(GroupsTrainer):
        def build_optimizer(self):
            return torch.optim.Adam(self.model.parameters(), lr=torch.tensor(0.01))

    rec = Recorder(interval=1)
    TensorLrTrainer(max_steps=3, hooks=[rec]).train()
    assert [s.lrs["group_0"] for _, s in rec.emitted] == pytest.approx([0.01, 0.01, 0.005])


def test_grad_norm_is_the_mean_before_clipping():
    stats, capture = StatsHook(interval=2), CaptureHook()
    TinyTrainer(max_steps=4, grad_clip=0.01, hooks=[stats, capture]).train()

    norms = [info.grad_norm.item() for info in capture.step_infos]
    assert all(norm > 0.01 for norm in norms)  # clipped, and reported unclipped
    assert capture.step_infos[1].get("stats").grad_norm == pytest.approx(mean(norms[:2]), rel=1e-6)
    assert capture.step_infos[3].get("stats").grad_norm == pytest.approx(mean(norms[2:]), rel=1e-6)
    assert capture.step_infos[3].get("stats").to_records()["grad_norm"] == capture.step_infos[3].get("stats").grad_norm


def test_retries_are_counted_in_their_window():
    rec, capture = Recorder(interval=2), CaptureHook()
    trainer = NanOnceTrainer(max_steps=4, nan_call=3, max_non_finite_grad_retries=2, hooks=[rec, capture])
    trainer.train()

    assert [(step, s.non_finite_grad_retries) for step, s in rec.emitted] == [(2, 0), (4, 1)]
    second = rec.emitted[1][1]
    # The NaN attempt's loss was dropped with the retry: the mean is over the kept attempts.
    kept = [loss.item() for info in capture.step_infos[2:] for loss in info.loss]
    assert math.isfinite(second.loss)
    assert second.loss == pytest.approx(mean(kept), rel=1e-6)


def test_peak_memory_is_the_max_of_the_window():
    rec = Recorder(interval=2)
    TinyTrainer(max_steps=5, hooks=[MemoryHook({1: 5.0, 2: 9.0, 3: 2.0, 4: 1.0}.get), rec]).train()
    assert [s.max_memory for _, s in rec.emitted] == [9.0, 2.0, None]
    assert "max_memory" in rec.emitted[0][1].to_records()
    assert "max_memory" not in rec.emitted[2][1].to_records()


# -- when it emits ------------------------------------------------------------------------------


def test_emits_at_multiples_of_interval_and_at_the_last_step():
    rec = Recorder(interval=3)
    TinyTrainer(max_steps=7, hooks=[rec]).train()
    assert [(step, s.step, s.steps) for step, s in rec.emitted] == [(3, 3, 3), (6, 6, 3), (7, 7, 1)]


def test_interval_follows_the_global_step_after_a_resume():
    first = TinyTrainer(max_steps=4, hooks=[])
    first.train()
    rec = Recorder(interval=3)
    resumed = TinyTrainer(max_steps=8, hooks=[rec])

    class Load(BaseHook):
        def on_enter_restoring(self, trainer):
            trainer.load_state_dict(first.state_dict())

    resumed._hooks.insert(0, Load())
    resumed.train()
    assert [(step, s.steps) for step, s in rec.emitted] == [(6, 2), (8, 2)]


def test_a_run_ended_by_an_exit_request_emits_its_last_steps():
    rec = Recorder(interval=3)
    TinyTrainer(max_steps=10, hooks=[ExitAt(4), rec]).train()
    assert [(step, s.step, s.steps) for step, s in rec.emitted] == [(3, 3, 3), (4, 4, 1)]


def test_a_run_ended_by_an_error_emits_nothing_more():
    class Boom(TinyTrainer):
        def forward(self, batch):
            if self.step == 5:
                raise RuntimeError("boom")
            return super().forward(batch)

    rec = Recorder(interval=3)
    with pytest.raises(RuntimeError, match="boom"):
        Boom(max_steps=10, hooks=[rec]).train()
    assert [step for step, _ in rec.emitted] == [3]


class _OpLog(TorchDispatchMode):
    """Records every aten op run while active (host syncs such as ``.item()`` included)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_steps_that_do_not_emit_run_no_tensor_op():
    class Watched(StatsHook):
        def __init__(self):
            super().__init__(interval=3)
            self.ops: list[tuple[int, list[str]]] = []

        def on_before_optimizer_step(self, trainer):
            with _OpLog() as log:
                super().on_before_optimizer_step(trainer)
            self.ops.append((trainer.step, log.ops))

        def on_after_step(self, trainer):
            with _OpLog() as log:
                super().on_after_step(trainer)
            self.ops.append((trainer.step, log.ops))

        def on_schedule(self, trainer):  # called on the emitting steps only
            with _OpLog() as log:
                super().on_schedule(trainer)
            self.ops.append((trainer.step, log.ops))

    hook = Watched()
    TinyTrainer(max_steps=6, grad_clip=1.0, gradient_accumulation_steps=2, hooks=[hook]).train()
    quiet = [ops for step, ops in hook.ops if step % 3]
    assert len(quiet) == 8
    assert all(ops == [] for ops in quiet)
    emitting = [ops for step, ops in hook.ops if step % 3 == 0 and ops]
    assert len(emitting) == 2  # the reduction happens on the emitting steps only
    for ops in emitting:
        # Losses, grad norms, both means together, the records: read by two ``tolist()``s,
        # never one ``.item()`` per value (``.item()`` dispatches ``_local_scalar_dense``).
        assert ops.count("aten.stack.default") == 4
        assert "aten._local_scalar_dense.default" not in ops


# -- bad records, bad parameters ----------------------------------------------------------------


def test_a_non_scalar_tensor_record_is_named_in_the_error():
    trainer = RecordsTrainer(max_steps=2, extra={"vec": torch.ones(3)}, hooks=[StatsHook(interval=2)])
    with pytest.raises(ValueError, match="'vec'"):
        trainer.train()


def test_a_non_number_record_is_named_in_the_error():
    trainer = RecordsTrainer(max_steps=2, extra={"deep": {"label": "cat"}}, hooks=[StatsHook(interval=2)])
    with pytest.raises(TypeError, match="'deep/label'"):
        trainer.train()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"interval": 0}, "interval"),
        ({"interval": -3}, "interval"),
        ({"interval": "10"}, "interval"),
        ({"interval": 2.5}, "interval"),
        ({"sync": "yes"}, "sync"),
        ({"sync": 1}, "sync"),
    ],
)
def test_bad_parameters_are_named(kwargs, name):
    with pytest.raises(ValidationError) as error:
        StatsHook(**kwargs)
    assert error.value.errors()[0]["loc"][-1] == name


def test_declarable_in_settings():
    assert HOOK_TYPES["stats"] is StatsHook
    model = hook_settings_model(StatsHook)
    hook = model.model_validate_json('{"type": "stats", "interval": 5, "sync": false}').build()
    assert isinstance(hook, StatsHook)
    assert (hook.interval, hook.sync) == (5, False)
    assert model(type="stats").build().interval == 10
    with pytest.raises(ValidationError, match="interval"):
        model.model_validate_json('{"type": "stats", "interval": 0}')
    with pytest.raises(ValidationError, match="intervall"):
        model.model_validate_json('{"type": "stats", "intervall": 5}')


# -- across ranks -------------------------------------------------------------------------------


class _RankTrainer(RecordsTrainer):
    """Rank-specific data and records; rank 1 alone records ``only_rank1``."""

    def __init__(self, *args, rank: int, **kwargs):
        extra = {"rank": float(rank), **({"only_rank1": 3.0} if rank == 1 else {})}
        super().__init__(*args, data=DataLoader(make_data(seed=rank), batch_size=8), extra=extra, **kwargs)


def _sync_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        local, synced, logs = Recorder(interval=2, sync=False), Recorder(interval=2, sync=True), LogCapture()
        memory = MemoryHook({1: 10.0 + rank, 2: 20.0 * (rank + 1), 3: 1.0}.get)
        trainer = _RankTrainer(
            max_steps=3, grad_clip=1.0, rank=rank,
            hooks=[memory, local, synced, LoggingHook(interval=2), logs],
        )
        trainer.train()
        result = {
            "local": [dataclasses.asdict(s) for _, s in local.emitted],
            "synced": [dataclasses.asdict(s) for _, s in synced.emitted],
            "logged": [records for _, records in logs.logged],
            "synced_records": [s.to_records() for _, s in synced.emitted],
        }
        Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
    finally:
        destroy(barrier=sys.exc_info()[0] is None)  # wait for every rank: a clean gloo exit


def test_sync_averages_across_two_gloo_ranks(tmp_path):
    mp.spawn(_sync_worker, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(2)]
    assert results[0]["synced"] == results[1]["synced"]  # every rank sees the same numbers
    assert results[0]["logged"] == results[1]["logged"] == results[0]["synced_records"]

    for window in range(2):  # steps 1-2, then step 3
        locals_ = [r["local"][window] for r in results]
        synced = results[0]["synced"][window]
        assert locals_[0]["loss"] != locals_[1]["loss"]  # different data per rank
        for key in ("loss", "grad_norm", "step_time", "data_time"):
            assert synced[key] == pytest.approx(mean(s[key] for s in locals_), rel=1e-9)
        assert synced["max_memory"] == max(s["max_memory"] for s in locals_)
        assert synced["records"]["rank"] == 0.5
        assert synced["records"]["only_rank1"] == 3.0
        assert synced["records"]["mse"] == pytest.approx(mean(s["records"]["mse"] for s in locals_))
        assert synced["lrs"] == locals_[0]["lrs"] == {"group_0": 0.05}
    assert [s["max_memory"] for s in results[0]["synced"]] == [40.0, 1.0]


def test_sync_without_a_process_group_is_local():
    synced, local = Recorder(interval=2, sync=True), Recorder(interval=2, sync=False)
    TinyTrainer(max_steps=2, hooks=[synced, local]).train()
    assert not dist.is_initialized()
    assert synced.emitted[0][1] == local.emitted[0][1]
