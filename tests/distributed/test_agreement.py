"""Exit agreement: a request holds at once alone; across ranks, without a collective per step."""

import torch
import torch.multiprocessing as mp
from ddp_worker import agreements_closed, collectives_per_step, exit_agreement, free_port

from trainloop.distributed.agreement import ExitAgreement

WORLD = 2


def run(fn, tmp_path, *args):
    mp.spawn(fn, args=(WORLD, free_port(), str(tmp_path), *args), nprocs=WORLD, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def test_without_a_process_group_a_request_holds_at_once():
    agreement = ExitAgreement()
    assert not agreement.active
    assert agreement.settle(0) == 0
    assert agreement.settle(144) == 144
    agreement.close()  # nothing in flight: a no-op


def test_an_exit_request_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    results = run(exit_agreement, tmp_path)
    # Requested after step 3 on rank 1 alone. Agreements start at steps 1, 2, 4, ... at the
    # most (never more steps apart than the run has steps), each read one step later: the
    # request is agreed at step 3's or step 4's, so both ranks stop after step 4 or 5.
    assert results[0] == results[1], results
    assert results[0]["code"] == 143
    assert results[0]["state"] == "exiting"
    assert results[0]["step"] in (4, 5)


def test_a_multi_rank_run_does_not_do_a_collective_on_every_step(tmp_path):
    """Two DDP ranks on gloo, 400 tiny steps, every torch.distributed collective counted."""
    steps = 400
    results = run(collectives_per_step, tmp_path, steps)
    for result in results:
        assert result["step"] == steps
        calls = result["calls"]
        # The agreements start at steps 1, 2, 4, 8, ... then about every 0.1 s: a tiny step takes
        # a few milliseconds, so a few dozen at most (it was one on every step: 400).
        assert sum(calls.values()) <= steps // 4, calls
        # never more than one on a step (the first also checks once that the ranks' batches differ)
        assert max(n for step, n in calls.items() if step > 1) == 1, calls
        assert {1, 2} <= set(calls)  # the first agreements: requests early in a run are quick
    assert results[0]["calls"] == results[1]["calls"]  # every rank agrees at the same steps


def test_nothing_is_left_in_flight_when_an_agreement_closes_or_a_run_ends(tmp_path):
    """Issue 29: ranks aborted at exit ("terminate called without an active exception") when gloo's
    worker thread, still holding the last agreement's tensor after ``wait()`` returned (about one
    wait in twenty), freed it while the interpreter shut down. Closing now waits for the backend
    to let go, every time."""
    rounds = 100
    results = run(agreements_closed, tmp_path, rounds)
    for result in results:
        pending = [was for was, _ in result["closed"]]
        assert pending.count(True) == pending.count(False) == rounds // 2  # both ways of closing ran
        assert [in_flight for _, in_flight in result["closed"]] == [False] * rounds
        assert result["step"] == 16
        assert result["run_in_flight"] is False
