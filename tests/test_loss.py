import pytest
import torch
from token_data import (
    TokenTrainer,
    mean_over_tokens_trainer,
    model_params,
    sequences,
    stack,
)

from trainloop import Loss


def test_loss_sum_count_with_accumulation_matches_the_mean_over_all_tokens_of_one_batch():
    seqs = sequences()
    # 2 steps of 4 microsteps (one sequence each) vs 2 steps of one batch of 4 sequences.
    accumulated = TokenTrainer(max_steps=2, gradient_accumulation_steps=4, data=seqs)
    accumulated.train()
    reference = mean_over_tokens_trainer([stack(seqs[:4]), stack(seqs[4:])], max_steps=2)
    reference.train()
    for a, b in zip(model_params(accumulated), model_params(reference)):
        torch.testing.assert_close(a, b)
    # A plain per-microstep mean would weigh a 1-token sequence like an 8-token one: different.
    per_microstep = mean_over_tokens_trainer(seqs, max_steps=2, gradient_accumulation_steps=4)
    per_microstep.train()
    assert not torch.allclose(model_params(per_microstep)[0], model_params(reference)[0])


def test_step_info_losses_are_per_item_means():
    trainer = TokenTrainer(max_steps=1, gradient_accumulation_steps=2, data=sequences())
    trainer.train()
    assert len(trainer.step_info.loss) == 2
    assert all(loss.ndim == 0 for loss in trainer.step_info.loss)


def test_mixing_plain_and_summed_losses_in_one_step_is_an_error():
    class Mixed(TokenTrainer):
        def forward(self, batch):
            loss, records = super().forward(batch)
            return (loss if self.step_info.loss else loss.sum / loss.count), records

    with pytest.raises(TypeError, match="mixed plain losses and Loss\\(sum, count\\) in one step"):
        Mixed(max_steps=1, gradient_accumulation_steps=2, data=sequences()).train()


def test_a_non_scalar_sum_is_an_error():
    class Bad(TokenTrainer):
        def forward(self, batch):
            return Loss(torch.ones(2), 2), {}

    with pytest.raises(TypeError, match=r"must return a scalar tensor Loss.sum, got a tensor of shape \(2,\)"):
        Bad(max_steps=1, data=sequences()).train()
