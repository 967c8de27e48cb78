"""The path of one checkpointed training step through trainloop's modules.

A tiny model trains two steps with a synchronous full save due at step 2. Every Python call
inside ``trainloop`` from step 2's ``on_before_step`` until its checkpoint is published is
recorded (``sys.setprofile``; imports and the first step warmed everything up). A call from
module A into module B is the pair ``A -> B`` (A is the innermost ``trainloop`` frame below the
call, so a call that goes through torch still counts as A's); a pair doubles back when B,
called from A, calls into A again before it returns.

Prints the modules touched, the distinct pairs, those that double back, and the calls.
``tests/test_step_walk.py`` holds the aim (docs/architecture.md).

Run: ``python benchmarks/step_walk.py [--pairs]``
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

import trainloop
from trainloop import BaseHook, BaseTrainer, CheckpointingHook

PACKAGE = str(Path(trainloop.__file__).parent)


@dataclass
class Walk:
    """What the walk saw: module names are dotted, relative to the package (``core.loop``)."""

    calls: int = 0
    modules: set[str] = field(default_factory=set)
    pairs: set[tuple[str, str]] = field(default_factory=set)
    doubled_back: set[tuple[str, str]] = field(default_factory=set)


def _module(filename: str) -> str | None:
    if not filename.startswith(PACKAGE):
        return None
    return filename[len(PACKAGE) + 1:].removesuffix(".py").replace("/", ".")


class _Tracer:
    """A ``sys.setprofile`` function keeping a stack of the ``trainloop`` modules being run."""

    def __init__(self) -> None:
        self.walk = Walk()
        self.stack: list[tuple[object, str, str | None]] = []  # (frame, module, the caller's module)

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            module = _module(frame.f_code.co_filename)
            if module is None:
                return
            caller = self.stack[-1][1] if self.stack else None
            walk = self.walk
            walk.calls += 1
            walk.modules.add(module)
            if caller is not None and caller != module:
                walk.pairs.add((caller, module))
                # B (module) was called from A (caller): does an open frame of A call B that calls A?
                for _, open_module, open_caller in reversed(self.stack):
                    if open_module == caller and open_caller == module:
                        walk.doubled_back.add((module, caller))
                        break
            self.stack.append((frame, module, caller))
        elif event == "return" and self.stack and self.stack[-1][0] is frame:
            self.stack.pop()


class _Tiny(BaseTrainer):
    def __init__(self, *args, hooks=(), **kwargs):
        super().__init__(*args, **kwargs)
        self._hooks = list(hooks)

    def build_data_loader(self):
        g = torch.Generator().manual_seed(0)
        return torch.utils.data.DataLoader(torch.randn(64, 4, generator=g), batch_size=8)

    def build_model(self):
        torch.manual_seed(0)
        return nn.Linear(4, 1)

    def build_optimizer(self):
        return torch.optim.SGD(self.model.parameters(), lr=0.1)

    def build_hooks(self):
        return self._hooks

    def forward(self, batch):
        return self.model(batch).pow(2).mean(), {}


class _StartAtStep2(BaseHook):
    """Starts the tracer in step 2's ``on_before_step`` (a hook called first)."""

    def __init__(self, tracer: _Tracer) -> None:
        self.tracer = tracer

    def on_before_step(self, trainer) -> None:
        if trainer.step == 2:
            sys.setprofile(self.tracer)


def walk_one_step() -> Walk:
    """Train 3 steps with a save due at step 2 and walk step 2 until its checkpoint is published."""
    tracer = _Tracer()
    logger = logging.getLogger("benchmarks.step_walk")
    logger.addHandler(logging.NullHandler())
    logger.propagate = False
    with tempfile.TemporaryDirectory() as workspace:
        # A first run warms up every import the walk would otherwise see.
        _Tiny(max_steps=2, workspace=Path(workspace) / "warm", logger=logger,
              hooks=[CheckpointingHook(interval=2)]).train()
        hook = CheckpointingHook(interval=2, exit_signals=[])
        trainer = _Tiny(max_steps=3, workspace=Path(workspace) / "walk", logger=logger,
                        hooks=[_StartAtStep2(tracer), hook])

        def published(t) -> None:  # the checkpoint is in place: stop at once
            sys.setprofile(None)

        trainer.on_exit("checkpointing", published)
        try:
            trainer.train()
        finally:
            sys.setprofile(None)
    # The walk's own hooks are not trainloop: drop what the tracer's exit callback added.
    return tracer.walk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", action="store_true", help="list the pairs and the modules")
    args = parser.parse_args()
    walk = walk_one_step()
    print(f"modules touched: {len(walk.modules)}")
    print(f"module-to-module call pairs: {len(walk.pairs)}")
    print(f"pairs that double back (A -> B -> A): {len(walk.doubled_back)}")
    print(f"calls: {walk.calls}")
    if args.pairs:
        print("modules:", ", ".join(sorted(walk.modules)))
        for a, b in sorted(walk.pairs):
            mark = "  (doubles back)" if (a, b) in walk.doubled_back else ""
            print(f"  {a} -> {b}{mark}")


if __name__ == "__main__":
    main()
