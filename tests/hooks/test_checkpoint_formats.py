"""CheckpointingHook formats (full, sharded) and background saves: layouts, resuming (also on
another number of ranks), and what a background save may and may not do before it completes."""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path

import checkpoint_child
import pytest
import torch
import torch.multiprocessing as mp
from checkpoint_child import FORMAT_CASES, StartedAt, StepDataTrainer
from ddp_worker import free_port
from helper_hooks import CaptureHook, CounterHook, SignalAtStep
from tiny_trainer import TinyTrainer

from trainloop import BaseHook
from trainloop.checkpoint import checkpoint_format, checkpoint_steps, read_checkpoint, read_metadata, verify_checkpoint
from trainloop.hooks import Schedule
from trainloop.hooks.checkpointing import CheckpointingHook

FORMATS = ["full", "sharded"]
WORLD = 2


# -- helpers ---------------------------------------------------------------------------------


class MomentumTrainer(TinyTrainer):
    """TinyTrainer with optimizer and scheduler state, so a resume has something to restore."""

    def build_optimizer(self):
        return torch.optim.SGD(self.model.parameters(), lr=self.lr, momentum=0.9)

    def build_lr_scheduler(self):
        return torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=5, gamma=0.5)


class Gate:
    """A checkpoint entry whose pickling waits until the test opens the gate: it holds a
    background write for as long as the test wants, with no timing involved."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.pickled_on: list[str] = []

    def __deepcopy__(self, memo):
        return self  # staging copies the state; the gate must stay this one object

    def __reduce__(self):
        self.pickled_on.append(threading.current_thread().name)
        if not self.opened.wait(timeout=60):
            raise TimeoutError("the gate was never opened: the loop waited for the write")
        return (str, ("gate",))


class GatedHook(BaseHook):
    """Puts a :class:`Gate` in the checkpoint of step ``at`` and checks, ``after`` steps later,
    that the loop went on while that write was held; then opens the gate."""

    def __init__(self, at: int, after: int, root: Path) -> None:
        self.gate, self.at, self.after, self.root = Gate(), at, after, root
        self.seen_while_held: list[tuple[int, str | None, bool]] = []

    def on_state_dict(self, trainer, state_dict):
        if trainer.step == self.at:
            state_dict[self.name] = {"gate": self.gate}

    def on_after_step(self, trainer):
        if self.at < trainer.step <= self.at + self.after:
            link = self.root / "latest"
            self.seen_while_held.append(
                (trainer.step, os.readlink(link) if link.is_symlink() else None, (self.root / str(self.at)).exists())
            )
        if trainer.step == self.at + self.after:
            self.gate.opened.set()


class SavesInFlight(BaseHook):
    """After each save began (in ``checkpointing``, after CheckpointingHook): how many background
    writes are alive, and where ``latest`` points."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.seen: list[tuple[int, int, str | None]] = []
        self.schedule = Schedule(1, state="checkpointing")

    def on_schedule(self, trainer):
        alive = [t for t in threading.enumerate() if t.name.startswith("checkpoint-")]
        link = self.root / "latest"
        self.seen.append((trainer.step, len(alive), os.readlink(link) if link.is_symlink() else None))


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def assert_same(a: list[torch.Tensor], b: list[torch.Tensor], exact: bool = True) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if exact:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y)


def run(workspace: Path, max_steps: int, *hooks: BaseHook, trainer_class=MomentumTrainer, **kwargs):
    trainer = trainer_class(max_steps=max_steps, workspace=workspace, hooks=list(hooks), **kwargs)
    trainer.train()
    return trainer


# -- one process -----------------------------------------------------------------------------


@pytest.mark.parametrize("format", FORMATS)
def test_layout_and_reading_back(tmp_path, format):
    counter = CounterHook()
    trainer = run(tmp_path, 8, counter, CheckpointingHook(interval=8, format=format))
    directory = tmp_path / "checkpoints" / "8"
    names = sorted(p.name for p in directory.iterdir())
    if format == "full":
        assert names == ["counter_hook.pt", "manifest.json", "metadata.json", "model.pt", "training_state.pt"]
    else:
        assert names == ["manifest.json", "metadata.json", "sharded", "training_state.pt"]
        assert sorted(p.name for p in (directory / "sharded").iterdir()) == [".metadata", "__0_0.distcp"]
        # The rest of the training state is a plain file, without the optimizer (in the shards).
        assert "optimizer" not in torch.load(directory / "training_state.pt", weights_only=True)
    assert checkpoint_format(directory) == format
    assert read_metadata(directory)["format"] == format
    assert set(verify_checkpoint(directory)) == {
        p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file() and p.name != "manifest.json"
    }

    saved = read_checkpoint(directory)
    expected = trainer.state_dict()
    assert saved.keys() == expected.keys() == {"model", "training_state", "counter_hook"}
    assert saved["counter_hook"] == {"count": 8}
    assert_same(list(saved["model"].values()), list(expected["model"].values()))
    ours, theirs = saved["training_state"], expected["training_state"]
    assert ours.keys() == theirs.keys()
    for key in ("step", "epoch", "lr_scheduler", "grad_scaler", "settings", "data_loader"):
        assert ours[key] == theirs[key], key
    assert ours["optimizer"]["param_groups"] == theirs["optimizer"]["param_groups"]
    for name, state in theirs["optimizer"]["state"].items():
        assert torch.equal(ours["optimizer"]["state"][name]["momentum_buffer"], state["momentum_buffer"])
    assert torch.equal(ours["rng"][0]["torch"], theirs["rng"][0]["torch"])


@pytest.mark.parametrize("async_save", [False, True])
@pytest.mark.parametrize("format", FORMATS)
def test_resume_matches_an_uninterrupted_run(tmp_path, format, async_save):
    straight = run(tmp_path / "straight", 16)
    run(tmp_path / "split", 8, CounterHook(), CheckpointingHook(interval=4, format=format, async_save=async_save))
    capture, counter = CaptureHook(), CounterHook()
    hook = CheckpointingHook(interval=4, format=format, async_save=async_save)
    resumed = run(tmp_path / "split", 16, capture, counter, hook)
    assert capture.events("on_before_train")[0][2] == 8
    assert counter.found
    assert counter.count == 16
    assert resumed.lr_scheduler.state_dict() == straight.lr_scheduler.state_dict()
    assert_same(params(resumed.model), params(straight.model))
    root = tmp_path / "split" / "checkpoints"
    assert checkpoint_steps(root) == [16]
    assert os.readlink(root / "latest") == "16"
    assert checkpoint_format(root / "16") == format
    assert not [p for p in root.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize(("saved_as", "resumed_as"), [("full", "sharded"), ("sharded", "full")])
def test_a_checkpoint_loads_in_its_own_format(tmp_path, saved_as, resumed_as):
    straight = run(tmp_path / "straight", 16)
    run(tmp_path / "split", 8, CheckpointingHook(interval=8, format=saved_as))
    capture = CaptureHook()
    resumed = run(tmp_path / "split", 16, capture, CheckpointingHook(interval=8, format=resumed_as))
    assert capture.events("on_before_train")[0][2] == 8
    assert_same(params(resumed.model), params(straight.model))
    assert checkpoint_format(tmp_path / "split" / "checkpoints" / "16") == resumed_as


def test_a_hook_without_state_in_a_sharded_checkpoint_sees_none(tmp_path):
    run(tmp_path, 4, CheckpointingHook(interval=4, format="sharded"))
    counter, capture = CounterHook(), CaptureHook()
    run(tmp_path, 6, counter, capture, CheckpointingHook(interval=4, format="sharded"))
    assert capture.events("on_before_train")[0][2] == 4
    assert counter.found is False
    assert counter.count == 2  # it started afresh, told by the absence


@pytest.mark.parametrize("format", FORMATS)
def test_background_write_lets_the_loop_run_and_latest_waits_for_it(tmp_path, format):
    root = tmp_path / "checkpoints"
    gated = GatedHook(at=2, after=2, root=root)
    hook = CheckpointingHook(interval=2, keep_previous=5, format=format, async_save=True)
    run(tmp_path, 6, gated, hook)
    # Steps 3 and 4 ran while the write of step 2 was held: it was neither named nor `latest`.
    assert gated.seen_while_held == [(3, None, False), (4, None, False)]
    assert gated.gate.pickled_on
    assert all(name != "MainThread" for name in gated.gate.pickled_on)
    # The save of step 4 waited for it; the end of the run waited for the last one.
    assert checkpoint_steps(root) == [2, 4, 6]
    assert os.readlink(root / "latest") == "6"
    for step in (2, 4, 6):
        verify_checkpoint(root / str(step))


@pytest.mark.parametrize("format", FORMATS)
def test_one_background_save_at_a_time(tmp_path, format):
    root = tmp_path / "checkpoints"
    observer = SavesInFlight(root)
    run(tmp_path, 5, CheckpointingHook(interval=1, keep_previous=1, format=format, async_save=True), observer)
    # Each save began once the previous one was complete and `latest` pointed at it.
    assert observer.seen == [(1, 1, None), (2, 1, "1"), (3, 1, "2"), (4, 1, "3"), (5, 1, "4")]
    assert not [t for t in threading.enumerate() if t.name.startswith("checkpoint-")]
    assert checkpoint_steps(root) == [4, 5]
    assert os.readlink(root / "latest") == "5"



@pytest.mark.parametrize("format", FORMATS)
def test_an_exit_signal_saves_in_the_background_and_the_exit_waits_for_it(tmp_path, format):
    hook = CheckpointingHook(interval=100, exit_signals=["SIGUSR1"], format=format, async_save=True)
    with pytest.raises(SystemExit) as exit:
        run(tmp_path, 50, SignalAtStep(3, signal.SIGUSR1), hook)
    assert exit.value.code == 128 + signal.SIGUSR1
    root = tmp_path / "checkpoints"
    assert checkpoint_steps(root) == [3]
    assert os.readlink(root / "latest") == "3"
    assert read_checkpoint(root / "latest")["training_state"]["step"] == 3


def test_a_background_save_completes_before_the_hook_loads_again(tmp_path):
    hook = CheckpointingHook(interval=2, format="sharded", async_save=True)
    run(tmp_path, 4, hook)
    capture = CaptureHook()
    run(tmp_path, 6, capture, hook)  # the same hook object, used by a second run
    assert capture.events("on_before_train")[0][2] == 4
    assert checkpoint_steps(tmp_path / "checkpoints") == [6]


# -- two processes: DDP and FSDP2 over gloo, resumed on two ranks and on one -------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The 2-rank runs of ``checkpoint_child.formats_worker``, done once for this module.

    Forked, not spawned: the ranks start without importing torch again (each sets one thread
    first, as OpenMP's pool does not survive a fork).
    """
    out = tmp_path_factory.mktemp("two_ranks")
    mp.start_processes(
        checkpoint_child.formats_worker, args=(WORLD, free_port(), str(out)), nprocs=WORLD, start_method="fork"
    )
    return [torch.load(out / f"rank{rank}.pt", weights_only=True) for rank in range(WORLD)], out


def test_two_ranks_resume_every_format_exactly(two_ranks):
    results, out = two_ranks
    straight = results[0]["straight"]
    assert_same(results[1]["straight"], straight)
    for label, (_wrap, format, _) in FORMAT_CASES.items():
        for result in results:
            assert result[label]["started"] == 4, label
            assert_same(result[label]["params"], straight)
        root = out / label / "checkpoints"
        assert checkpoint_steps(root) == [4, 8]
        for step in (4, 8):
            verify_checkpoint(root / str(step))
            assert checkpoint_format(root / str(step)) == format
    # FSDP shards the parameters: each rank wrote its own file.
    shards = out / "fsdp_sharded_async" / "checkpoints" / "8" / "sharded"
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert all(p.stat().st_size > 0 for p in shards.iterdir())


def test_two_ranks_resume_several_optimizers_sharded_exactly(two_ranks):
    results, out = two_ranks
    for result in results:
        cases = result["two_optimizers"]
        for wrap in ("ddp", "fsdp"):
            assert cases[wrap]["started"] == 4, wrap
            assert_same(cases[wrap]["params"], cases["straight"])
            for name, buffers in cases["state"].items():
                assert_same(cases[wrap]["state"][name], buffers)
    assert checkpoint_format(out / "fsdp_two_optimizers" / "checkpoints" / "8") == "sharded"


def test_full_format_refuses_fsdp_shards(two_ranks):
    results, _ = two_ranks
    for result in results:
        assert "format='full' got a sharded tensor (DTensor) at 'model.0.weight'" in result["full_refused"]
        assert "full_state_dict=True" in result["full_refused"]


@pytest.mark.parametrize("label", ["ddp_sharded", "fsdp_sharded_async", "ddp_full_async"])
def test_two_rank_checkpoint_resumes_in_one_process(two_ranks, tmp_path, label, caplog):
    results, out = two_ranks
    started = StartedAt()
    hook = CheckpointingHook(interval=100, load=out / label / "checkpoints" / "4")
    with caplog.at_level(logging.WARNING, logger="trainloop"):
        resumed = run(tmp_path, 8, started, hook, trainer_class=StepDataTrainer)
    assert started.step == 4
    # The same global batches on one rank: equal up to the order of the sums.
    assert_same(params(resumed.model), results[0]["straight"], exact=False)
    assert "random states of 2 ranks and this run has 1" in caplog.text
