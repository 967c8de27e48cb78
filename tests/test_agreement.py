import torch
import torch.multiprocessing as mp
from ddp_worker import collectives_per_step, free_port

from trainloop.distributed.agreement import MAX_STEPS_BETWEEN, ExitAgreement


def test_without_a_process_group_a_request_holds_at_once():
    agreement = ExitAgreement()
    assert not agreement.active
    assert agreement.settle(0) == 0
    assert agreement.settle(144) == 144
    agreement.close()  # nothing in flight: a no-op


def test_two_ranks_agree_without_a_collective_on_every_step(tmp_path):
    # Two gloo processes, a plain model (no DDP: the agreement is the loop's only collective);
    # rank 1 alone asks to exit after step 300, and every collective call is counted.
    world = 2
    mp.spawn(collectives_per_step, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]
    steps = {r["step"] for r in results}
    assert len(steps) == 1, results  # every rank stopped after the same step
    step = steps.pop()
    assert 301 <= step <= 301 + MAX_STEPS_BETWEEN  # within the documented latency
    assert [r["code"] for r in results] == [143, 143]
    calls = results[0]["calls"]
    assert calls == results[1]["calls"]
    assert set(calls) == {"all_reduce"}
    # One per agreement step: one per step only if steps took AGREE_WITHIN or longer, which
    # this model's do not (a few ms each), so far fewer.
    assert len(calls) < step / 4, f"{len(calls)} collectives in {step} steps"
