"""Exact resume across processes: a run stopped by a real SIGTERM, or killed by SIGKILL after a
checkpoint, and resumed in a new process ends bitwise identical to a run that never stopped.

The runs (dropout, a shuffling StatefulDataLoader, gradient accumulation 1 and 3, one process
and two DDP ranks on gloo) are in ``resume_child.py``. Children are few and started together,
since each pays for importing torch: every run to be stopped at once, then every resume at once
(one new process resumes the single-process workspaces one after another). Stops are
deterministic by a handshake: the child blocks on stdin at the chosen moment, the test sends
its real signal, then lets it go on.
"""

from __future__ import annotations

import functools
import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from child_process import HIDDEN_GPUS, ChildProcess
from ddp_worker import free_port

from trainloop import State
from trainloop.checkpoint import checkpoint_steps, latest_checkpoint, read_checkpoint

pytest.importorskip("torchdata.stateful_dataloader")
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")

TESTS = Path(__file__).resolve().parents[1]
CHILD = TESTS / "support" / "resume_child.py"
TIMEOUT = 240  # seconds; generous: children share two cores with other work

MAX_STEPS = 17
TERM_AT = 7  # SIGTERM arrives as this step begins: mid-epoch (batch 2 of 5 in epoch 1)
KILL_AT = 5  # SIGKILL once `latest` points here: with accumulation 3, an epoch's end (15 batches)
DDP_MAX_STEPS = 12
DDP_TERM_AT = 5  # rank 1 is signalled as step 5 begins; the ranks agree to stop after step 6 to 9
DDP_LATEST_STOP = 9  # agreements start at steps 1, 2, 4, 8 at the most, each read one step later


# -- children --------------------------------------------------------------------------------


STARTED: list[Child] = []  # every child, so that none outlives a failed test


class Child(ChildProcess):
    """``resume_child.py`` in a new process, registered so that none outlives a failed test."""

    def __init__(self, tmp: Path, runs: list[dict[str, Any]], env: dict[str, str] | None = None) -> None:
        super().__init__(CHILD, [json.dumps(runs)], tmp, env)
        STARTED.append(self)

    def wait_for(self, line: str) -> str:  # type: ignore[override]
        """Block until the child prints exactly ``line``."""
        return super().wait_for(line, timeout=TIMEOUT, exact=True)

    def resume(self) -> None:
        """Let a paused child go on."""
        self.send("")

    def finish(self) -> int:  # type: ignore[override]
        """Wait for the exit; read the remaining lines; return the exit code."""
        return super().finish(timeout=TIMEOUT)


def ranks(tmp: Path, runs: list[dict[str, Any]], world: int = 2) -> list[Child]:
    """``world`` children joined in one gloo group, as torchrun would start them."""
    port = str(free_port())
    return [
        Child(
            tmp,
            runs,
            env={
                "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, **HIDDEN_GPUS,
            },
        )
        for rank in range(world)
    ]


def load_out(out: Path, rank: int = 0) -> dict[str, Any]:
    return torch.load(f"{out}.rank{rank}", weights_only=True)


@functools.cache
def reference_params(accumulation: int) -> list[torch.Tensor]:
    """The uninterrupted single-process run, in this process."""
    from resume_child import trainer_for

    trainer = trainer_for({"workspace": None, "max_steps": MAX_STEPS, "accumulation": accumulation}, [])
    trainer.train()
    return [p.detach().clone() for p in trainer.model.parameters()]


def assert_bitwise_equal(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        assert torch.equal(a, b), (a - b).abs().max()


# -- the runs --------------------------------------------------------------------------------

# One process: a SIGTERM mid-epoch, and a SIGKILL at an epoch's end with accumulation.
SCENARIOS = [("sigterm", 1), ("sigkill", 3)]
IDS = [f"{how}-accumulation{acc}" for how, acc in SCENARIOS]
DDP_ACCUMULATION = 3


def stop_single(tmp: Path, how: str, acc: int) -> tuple[dict[str, Any], Child]:
    """Start a single-process run that will be stopped; return its spec and its child."""
    run = {"workspace": str(tmp / f"{how}{acc}"), "max_steps": MAX_STEPS, "accumulation": acc}
    if how == "sigterm":
        stopped = {**run, "interval": 1000, "pause_before_step": TERM_AT}
    else:
        stopped = {**run, "interval": KILL_AT, "pause_after_save": KILL_AT}
    return run, Child(tmp, [stopped])


def finish_single(how: str, run: dict[str, Any], child: Child) -> dict[str, Any]:
    """Stop the run for real at its pause; return what is left on disk and how it ended."""
    root = Path(run["workspace"]) / "checkpoints"
    result: dict[str, Any] = {"root": root}
    if how == "sigterm":
        child.wait_for(f"0 paused {TERM_AT}")
        child.proc.send_signal(signal.SIGTERM)
        child.resume()
    else:
        child.wait_for(f"0 paused {KILL_AT}")
        result["latest_before_kill"] = latest_checkpoint(root)
        child.proc.send_signal(signal.SIGKILL)
    result["code"] = child.finish()
    result["lines"], result["stderr"] = child.lines, child.stderr()
    result["steps_on_disk"] = checkpoint_steps(root)
    result["latest"] = latest_checkpoint(root)
    assert result["latest"] is not None, f"{how}: no checkpoint; exit {result['code']}, {result['lines']}\n{result['stderr']}"
    # Read now: the resume saves its last step and prunes this one.
    result["checkpoint"] = read_checkpoint(result["latest"])
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Iterator[dict[str, Any]]:
    """What :func:`stop_and_resume` found; no child outlives the module."""
    try:
        yield stop_and_resume(tmp_path_factory.mktemp("runs"))
    finally:
        for child in STARTED:  # a paused child would otherwise wait for its line forever
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()


def stop_and_resume(tmp: Path) -> dict[Any, Any]:
    """Start every run to be stopped at once; stop each for real; resume each in new processes.

    One process: each scenario of ``SCENARIOS``, all resumed by one new process, one after
    another. Two DDP ranks (accumulation 3): first their uninterrupted reference, then the run
    whose rank 1 gets a SIGTERM; resumed by a new pair of ranks.
    """
    single = {(how, acc): stop_single(tmp, how, acc) for how, acc in SCENARIOS}
    ddp_run = {"workspace": str(tmp / "ddp"), "max_steps": DDP_MAX_STEPS, "accumulation": DDP_ACCUMULATION}
    pair = ranks(tmp, [
        {**ddp_run, "workspace": str(tmp / "ddp-ref"), "out": str(tmp / "ddp-ref.out")},
        {**ddp_run, "interval": 1000, "pause_before_step": DDP_TERM_AT, "pause_rank": 1},
    ])

    results: dict[Any, Any] = {key: finish_single(key[0], *spec) for key, spec in single.items()}
    resumed_runs = []
    for key, (run, _) in single.items():
        results[key]["out"] = tmp / f"{key[0]}{key[1]}.out"
        resumed_runs.append({**run, "interval": 1000, "out": str(results[key]["out"])})
    resumers = [Child(tmp, resumed_runs)]  # while the DDP runs go on

    pair[1].wait_for(f"1 paused {DDP_TERM_AT}")
    pair[1].proc.send_signal(signal.SIGTERM)  # one rank's process only
    pair[1].resume()
    results["ddp"] = {
        "codes": [child.finish() for child in pair],
        "lines": [child.lines for child in pair],
        "stderr": "\n".join(child.stderr() for child in pair),
        "root": tmp / "ddp" / "checkpoints",
    }
    results["ddp"]["checkpoint"] = read_checkpoint(latest_checkpoint(results["ddp"]["root"]))
    resumers += ranks(tmp, [{**ddp_run, "interval": 1000, "out": str(tmp / "ddp.out")}])
    codes = [child.finish() for child in resumers]
    assert codes == [0, 0, 0], "\n".join(child.stderr() for child in resumers)
    for key in single:
        results[key]["resumed"] = load_out(results[key]["out"])
    results["ddp"]["references"] = [load_out(tmp / "ddp-ref.out", rank) for rank in range(2)]
    results["ddp"]["resumed"] = [load_out(tmp / "ddp.out", rank) for rank in range(2)]
    return results


# -- one process -----------------------------------------------------------------------------


def test_sigterm_mid_run_saves_the_step_it_stopped_at_and_exits_143(runs):
    result = runs["sigterm", 1]
    assert result["code"] == 128 + signal.SIGTERM == 143, result["stderr"]
    # `exiting` ran (on_after_train, error None) before the process exited with 143.
    assert result["lines"] == ["0 started 0", f"0 paused {TERM_AT}", f"0 saved {TERM_AT}", f"0 done {TERM_AT}"]
    assert result["steps_on_disk"] == [TERM_AT]
    assert result["latest"] == result["root"] / str(TERM_AT)
    assert result["checkpoint"]["training_state"]["step"] == TERM_AT


def test_sigkill_after_a_save_leaves_latest_at_that_step(runs):
    result = runs["sigkill", 3]
    assert result["code"] == -signal.SIGKILL, result["stderr"]
    assert result["latest_before_kill"] == result["root"] / str(KILL_AT)
    assert result["lines"] == ["0 started 0", f"0 saved {KILL_AT}", f"0 paused {KILL_AT}"]
    assert result["steps_on_disk"] == [KILL_AT]
    assert result["latest"] == result["root"] / str(KILL_AT)
    assert result["checkpoint"]["training_state"]["step"] == KILL_AT


@pytest.mark.parametrize(("how", "accumulation"), SCENARIOS, ids=IDS)
def test_resumed_in_a_new_process_equals_the_uninterrupted_run(runs, how, accumulation):
    resumed = runs[how, accumulation]["resumed"]
    assert resumed["started"] == (TERM_AT if how == "sigterm" else KILL_AT)
    assert resumed["step"] == MAX_STEPS
    assert_bitwise_equal(resumed["params"], reference_params(accumulation))


def test_control_a_resume_without_the_saved_random_and_loader_state_ends_elsewhere(runs):
    """The bitwise equality above is evidence of an exact resume only if the run depends on
    what the checkpoint restores: resumed from the same checkpoint minus its random and
    data-loader states, the same run ends with other parameters."""
    from resume_child import trainer_for

    checkpoint = runs["sigterm", 1]["checkpoint"]
    checkpoint["training_state"]["rng"] = None  # then neither generators nor loader are restored
    workspace = runs["sigterm", 1]["root"].parent  # the same settings: no ChangedSettingsWarning
    trainer = trainer_for({"workspace": str(workspace), "max_steps": MAX_STEPS}, [])
    trainer.on_enter(State.RESTORING, lambda t: t.load_state_dict(checkpoint))
    trainer.train()
    assert trainer.step == MAX_STEPS
    got = [p.detach() for p in trainer.model.parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(got, reference_params(1)))


# -- two DDP ranks ---------------------------------------------------------------------------


def ddp_stop(ddp: dict[str, Any]) -> int:
    """The step the stopped DDP run saved at its exit (read from rank 0's lines)."""
    return int(ddp["lines"][0][-1].split()[-1])


def test_ddp_sigterm_to_one_rank_stops_both_after_the_agreed_step_with_143(runs):
    ddp = runs["ddp"]
    stop = ddp_stop(ddp)  # agreed without blocking and without a collective on every step
    assert DDP_TERM_AT < stop <= DDP_LATEST_STOP, ddp["lines"]
    assert ddp["codes"] == [143, 143], ddp["stderr"]
    for rank, lines in enumerate(ddp["lines"]):
        reference = [f"{rank} started 0", f"{rank} done {DDP_MAX_STEPS}"]  # no CheckpointingHook
        paused = [f"1 paused {DDP_TERM_AT}"] if rank == 1 else []
        assert lines == [*reference, f"{rank} started 0", *paused, f"{rank} saved {stop}", f"{rank} done {stop}"]
    assert checkpoint_steps(ddp["root"]) == [DDP_MAX_STEPS]  # the resume saved its end, pruned `stop`
    state = ddp["checkpoint"]["training_state"]
    assert state["step"] == stop
    assert len(state["rng"]) == len(state["data_loader"]) == 2  # per rank


def test_ddp_resumed_in_new_processes_equals_the_uninterrupted_run(runs):
    references, resumed = runs["ddp"]["references"], runs["ddp"]["resumed"]
    assert_bitwise_equal(references[1]["params"], references[0]["params"])  # DDP keeps ranks equal
    for rank in range(2):
        assert resumed[rank]["started"] == ddp_stop(runs["ddp"])
        assert resumed[rank]["step"] == DDP_MAX_STEPS
        assert_bitwise_equal(resumed[rank]["params"], references[rank]["params"])
