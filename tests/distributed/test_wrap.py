"""``wrap_model``'s activation checkpointing on one process: the same numbers, the same keys, fewer
saved bytes, recomputed forwards; and its bad input. Under two ranks (DDP, FSDP2) it is checked in
``test_distributed.py``'s wrapping spawn."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helper_hooks import CaptureHook
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainloop import BaseTrainer
from trainloop.distributed import wrap_model

WIDTH, BLOCKS, VOCAB, LENGTH = 16, 4, 32, 8


class Block(nn.Module):
    """A transformer block (dropout on: recomputation must redraw the same masks)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(WIDTH, 2, dim_feedforward=32, dropout=0.1, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


class CountedBlock(Block):
    """A block whose forwards are counted (not compiled: the count would be a guard that recompiles)."""

    def __init__(self) -> None:
        super().__init__()
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return super().forward(x)


class TinyLM(nn.Module):
    def __init__(self, block: type[Block] = Block) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(*(block() for _ in range(BLOCKS)))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def tiny_lm(block: type[Block] = Block) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(block)


def tokens(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(VOCAB, (n, LENGTH + 1), generator=g))


class LMTrainer(BaseTrainer):
    def __init__(self, *args, wrap=None, compile_backend=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.wrap = wrap or {}
        self.compile_backend = compile_backend
        self.capture = CaptureHook()

    def build_data_loader(self):
        return DataLoader(tokens(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2))

    def build_model(self):
        model = wrap_model(tiny_lm(), "none", **self.wrap)
        if self.compile_backend is not None:
            torch._dynamo.reset()
            return torch.compile(model, backend=self.compile_backend)
        return model

    def build_optimizer(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def build_hooks(self):
        return [self.capture]

    def forward(self, batch):
        (sequence,) = batch
        logits = self.model(sequence[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), sequence[:, 1:].reshape(-1))
        return loss, {}


def run(steps: int = 6, accumulation: int = 2, **kwargs) -> LMTrainer:
    torch.manual_seed(3)  # dropout's draws start alike in both runs
    trainer = LMTrainer(max_steps=steps, gradient_accumulation_steps=accumulation, grad_clip=1.0, **kwargs)
    trainer.train()
    return trainer


def losses(trainer: LMTrainer) -> list[torch.Tensor]:
    return [torch.stack(info.loss) for info in trainer.capture.step_infos]


@pytest.mark.parametrize("wrap", [
    {"activation_checkpointing": Block},
    {"activation_checkpointing": (Block, nn.Linear), "activation_checkpointing_every": 2},
    {"activation_checkpointing": lambda m: isinstance(m, nn.TransformerEncoderLayer)},
])
def test_a_checkpointed_run_trains_bit_for_bit_as_the_same_model_without_it(wrap):
    plain, checkpointed = run(), run(wrap=wrap)
    assert all(torch.equal(a, b) for a, b in zip(losses(plain), losses(checkpointed), strict=True))
    for a, b in zip(plain.model.parameters(), checkpointed.model.parameters(), strict=True):
        assert torch.equal(a, b)
    assert plain.optimizer.state_dict()["state"].keys() == checkpointed.optimizer.state_dict()["state"].keys()
    for a, b in zip(plain.optimizer.state.values(), checkpointed.optimizer.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_compiled_checkpointed_model_trains_as_the_compiled_model_without_it():
    # aot_eager: dynamo and AOT autograd trace the checkpoint as inductor would, without generating code
    try:
        plain = run(2, 1, compile_backend="aot_eager")
        checkpointed = run(2, 1, compile_backend="aot_eager", wrap={"activation_checkpointing": Block})
    finally:
        torch._dynamo.reset()  # nothing compiled here stays for the next test in this process
    assert all(torch.equal(a, b) for a, b in zip(losses(plain), losses(checkpointed), strict=True))
    for a, b in zip(plain.model.parameters(), checkpointed.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_state_dict_keys_are_unchanged_and_interchange_with_an_unchecked_model():
    plain, checkpointed = tiny_lm(), wrap_model(tiny_lm(), "none", activation_checkpointing=Block)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in checkpointed.named_parameters()] == [n for n, _ in plain.named_parameters()]
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(1.0)
    checkpointed.load_state_dict(plain.state_dict(), strict=True)
    plain.load_state_dict(checkpointed.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), checkpointed.state_dict().values()))


def test_checkpointed_blocks_run_forward_twice_in_training_and_once_under_no_grad():
    model = wrap_model(tiny_lm(CountedBlock), "none", activation_checkpointing=Block, activation_checkpointing_every=2)
    batch = tokens()[:4][0][:, :-1]
    model(batch).sum().backward()
    assert [block.forwards for block in model.blocks] == [1, 2, 1, 2]  # the 2nd and 4th matches
    with torch.no_grad():
        model(batch)
    assert [block.forwards for block in model.blocks] == [2, 3, 2, 3]


def saved_bytes(model: nn.Module) -> int:
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    batch = tokens()[:4][0][:, :-1]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(batch).sum()
    loss.backward()
    return total


def test_checkpointing_saves_fewer_bytes_for_backward():
    plain = saved_bytes(tiny_lm())
    every_block = saved_bytes(wrap_model(tiny_lm(), "none", activation_checkpointing=Block))
    every_other = saved_bytes(wrap_model(tiny_lm(), "none", activation_checkpointing=Block,
                                         activation_checkpointing_every=2))
    assert every_block < every_other < plain


def test_a_match_inside_a_match_is_not_checkpointed_twice():
    model = tiny_lm()
    wrap_model(model, "none", activation_checkpointing=lambda m: isinstance(m, Block | nn.TransformerEncoderLayer))
    layers = [block.layer for block in model.blocks]
    assert all(isinstance(block.forward, type(model.blocks[0].forward)) for block in model.blocks)
    assert all("forward" not in vars(layer) for layer in layers)  # their forward is their class's
    assert all("forward" in vars(block) for block in model.blocks)


@pytest.mark.parametrize(("kwargs", "said"), [
    ({"activation_checkpointing": nn.Conv2d}, "wrap_model activation_checkpointing=(Conv2d,) matched no submodule of TinyLM"),
    ({"activation_checkpointing": Block, "activation_checkpointing_every": 0},
     "wrap_model activation_checkpointing_every=0: a whole number, at least 1"),
    ({"activation_checkpointing": Block, "activation_checkpointing_every": True},
     "wrap_model activation_checkpointing_every=True: a whole number, at least 1"),
    ({"activation_checkpointing": 3},
     "wrap_model activation_checkpointing=3: a module class, a tuple of them, or a predicate fn(module) -> bool"),
    ({"activation_checkpointing": "Block"},
     "wrap_model activation_checkpointing='Block': a module class, a tuple of them, or a predicate fn(module) -> bool"),
    ({"activation_checkpointing": (Block, int)},  # (the module's name depends on how pytest imported it)
     "Block'>, <class 'int'>): a module class, a tuple of them, or a predicate fn(module) -> bool"),
])
def test_bad_activation_checkpointing_is_one_line_naming_it(kwargs, said):
    with pytest.raises(ValueError) as raised:
        wrap_model(tiny_lm(), "none", **kwargs)
    message = str(raised.value)
    assert message.startswith("wrap_model activation_checkpointing")
    assert said in message
    assert "\n" not in message


def test_a_block_given_as_a_module_rather_than_its_class_is_one_line_saying_so():
    with pytest.raises(ValueError, match=r"\(a module itself: give its class\)"):
        wrap_model(tiny_lm(), "none", activation_checkpointing=Block())


def test_the_docs_example_runs_as_written_and_prints_what_it_says(capsys):
    text = (Path(__file__).parents[2] / "docs" / "distributed.md").read_text()
    section = text[text.index("## Activation checkpointing"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]
    exec(compile(code, "docs/distributed.md", "exec"), {"__name__": "docs_example"})
    printed = capsys.readouterr().out
    claimed = code[code.rindex("# ") + 2:].split(";")[0]  # "0.2 MiB", the last line's comment
    assert printed.strip() == f"{claimed} saved for backward"
