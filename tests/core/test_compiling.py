"""CompileWatch in process, with dynamo's ``eager`` backend (it traces and guards as inductor does,
without generating code, so it is quick): the steps that compiled, the recompilation's reason, and
the statistics that leave them out. tests/processes/test_compiling.py runs CPU inductor for real."""

from __future__ import annotations

import itertools

import pytest
import torch
from tiny_trainer import TinyTrainer

from trainloop.core.compiling import CompileWatch
from trainloop.hooks.stats import StatsHook


class EagerCompiled(TinyTrainer):
    """TinyTrainer's model compiled with the eager backend, on batches of 2 samples, then 3 from step 4."""

    def build_data_loader(self):
        g = torch.Generator().manual_seed(0)
        sizes = itertools.chain([2, 2, 2], itertools.repeat(3))
        return ((torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)) for n in sizes)

    def build_model(self):
        torch._dynamo.reset()  # a fresh cache: the first step compiles whatever ran before
        return torch.compile(super().build_model(), backend="eager")


def test_the_steps_that_compiled_are_marked_with_the_recompilations_reason():
    stats = StatsHook(interval=6)
    trainer = EagerCompiled(max_steps=6, trace=True, hooks=[stats])
    trainer.train()
    first, again = trainer.trace.compiled
    assert (first.step, first.recompilation, first.reasons) == (1, False, ())
    assert (again.step, again.recompilation) == (4, True)
    assert "size mismatch at index 0. expected 2, actual 3" in again.reasons[0]
    latest = stats.latest
    assert (latest.compile_steps, latest.recompilations) == (2, 1)
    # The statistics' own sums: the compiling steps' time apart, the others' mean as step_time.
    assert latest.compile_time == pytest.approx(first.seconds + again.seconds)
    assert latest.to_records()["compile_steps"] == 2


def test_the_throughput_leaves_the_compiling_steps_out():
    from trainloop import Loss

    class Counted(EagerCompiled):
        def forward(self, batch):
            x, y = batch
            return Loss(((self.model(x) - y) ** 2).sum(), len(x)), {}

    stats = StatsHook(interval=6)
    Counted(max_steps=6, hooks=[stats]).train()
    assert stats.latest.throughput.items == 2 + 2 + 3 + 3  # steps 2, 3, 5, 6: 1 and 4 compiled


def test_a_run_that_does_not_compile_marks_nothing():
    stats = StatsHook(interval=3)
    trainer = TinyTrainer(max_steps=3, trace=True, hooks=[stats])
    trainer.train()
    assert trainer.trace.compiled == []
    assert stats.latest.compile_steps == 0
    assert "compile_steps" not in stats.latest.to_records()


def test_a_compilation_between_steps_is_not_the_next_steps():
    watch = CompileWatch()
    watch.begin()
    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2))  # compiled after begin: this step's
    assert watch.end(step=1, seconds=0.5) is not None
    torch.compile(lambda x: x * 2, backend="eager")(torch.ones(2))  # between steps
    watch.begin()
    assert watch.end(step=2, seconds=0.1) is None
