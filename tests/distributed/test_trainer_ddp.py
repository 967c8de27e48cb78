"""The trainer under real DDP: two gloo processes on the loopback interface."""

import torch
import torch.multiprocessing as mp
from ddp_worker import ddp_accumulation, ddp_loss_none, free_port
from tiny_trainer import TinyTrainer, make_data
from torch.utils.data import DataLoader

WORLD = 2


def run(fn, tmp_path, *args):
    mp.spawn(fn, args=(WORLD, free_port(), str(tmp_path), *args), nprocs=WORLD, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def test_ddp_with_accumulation_keeps_ranks_identical_and_matches_one_big_batch(tmp_path):
    results = run(ddp_accumulation, tmp_path, 2)
    for a, b in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(a, b)
    # no_sync on all but the last microstep: one per step of 2 microsteps, 4 steps.
    assert [r["no_sync_entries"] for r in results] == [4, 4]
    # 2 ranks x 2 microsteps x 4 samples = one step of 16 samples in one process.
    reference = TinyTrainer(max_steps=4, data=DataLoader(make_data(64), batch_size=16))
    reference.train()
    for a, b in zip(results[0]["params"], reference.unwrapped_model.parameters()):
        torch.testing.assert_close(a, b.detach())


def test_loss_none_warns_under_ddp(tmp_path):
    assert run(ddp_loss_none, tmp_path) == [["LossNoneWarning"]] * WORLD


def test_loss_sum_count_is_normalised_over_all_ranks_tokens(tmp_path):
    from ddp_worker import ddp_token_loss
    from token_data import mean_over_tokens_trainer, model_params, sequences, stack

    results = run(ddp_token_loss, tmp_path)
    reference = mean_over_tokens_trainer([stack(sequences()[:4])], max_steps=1)
    reference.train()
    for rank_params in results:
        for a, b in zip(rank_params, model_params(reference)):
            torch.testing.assert_close(a, b)
