"""``--trainer module:Class``.

Import the user's trainer class, and nothing but a clear line if its module cannot be used.

A trainer's module is the user's script, imported as a library. One that exits at import
(``sys.exit()``, or an ``argparse`` that reads trainloop's own command line and prints its usage)
would end trainloop silently or with another program's usage; it is reported as one line naming
the module instead, exit code 2.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import IO, TYPE_CHECKING, Any

from trainloop.cli.errors import CliError

if TYPE_CHECKING:
    from trainloop.trainer import BaseTrainer

__all__ = ["load_trainer_class"]

_GUARD_HINT = (
    "a trainer's module must not exit or parse the command line when imported: "
    'put that code under `if __name__ == "__main__":`'
)


class _HeldStream:
    """A stand-in for stdout/stderr that holds what a module writes while it imports.

    Afterwards it passes writes through (a logging handler set up at import keeps writing here).
    """

    def __init__(self, real: IO[str]) -> None:
        self._real = real
        self._held: list[str] | None = []

    def write(self, text: str) -> int:
        """Hold ``text`` while holding, else write it to the real stream."""
        if self._held is None:
            return self._real.write(text)
        self._held.append(text)
        return len(text)

    def flush(self) -> None:
        """Flush the real stream once the holding is over."""
        if self._held is None:
            self._real.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)  # encoding, isatty, fileno...: the real stream's

    def release(self) -> None:
        """Write what was held to the real stream; pass later writes through."""
        held, self._held = self._held or [], None
        self._real.write("".join(held))

    def last_line(self) -> str:
        """The last non-empty line held (what a module said before it exited)."""
        lines = [line.strip() for line in "".join(self._held or []).splitlines() if line.strip()]
        return lines[-1] if lines else ""


@contextmanager
def _held_output() -> Iterator[tuple[_HeldStream, _HeldStream]]:
    """Hold stdout and stderr while the block runs; release them unless it exits."""
    out, err = _HeldStream(sys.stdout), _HeldStream(sys.stderr)
    real_out, real_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = out, err  # all that print and logging use of a stream
    try:
        yield out, err
    except SystemExit:
        raise  # what it printed is summarised by the caller, not replayed
    except BaseException:
        out.release()
        err.release()
        raise
    else:
        out.release()
        err.release()
    finally:
        sys.stdout, sys.stderr = real_out, real_err


def _import_module(module_name: str, spec: str, given_as: str) -> ModuleType:
    """Import the user's module, each way it can fail reported as one ``CliError`` line."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        with _held_output() as (out, err):
            return importlib.import_module(module_name)
    except SystemExit as exit_:
        said = err.last_line() or out.last_line()
        said = f", saying {said!r}" if said else ""
        raise CliError(
            f"{given_as} {spec!r}: importing {module_name!r} exited (code {exit_.code!r}){said}; {_GUARD_HINT}"
        ) from None
    except ModuleNotFoundError as error:
        if error.name is not None and (module_name == error.name or module_name.startswith(error.name + ".")):
            raise CliError(f"{given_as} {spec!r}: no module named {error.name!r}") from None
        raise CliError(f"{given_as} {spec!r}: importing {module_name!r} failed: {error}") from None
    except Exception as error:  # noqa: BLE001 - the module's own code failed: say what, in one line
        message = " ".join(f"{type(error).__name__}: {error}".split())
        raise CliError(f"{given_as} {spec!r}: importing {module_name!r} failed: {message}") from None


def load_trainer_class(spec: str, given_as: str = "--trainer") -> type[BaseTrainer]:
    """Import the trainer class named ``module:Class`` (``Class`` may be dotted: ``Outer.Inner``).

    The working directory is importable, so ``train:MyTrainer`` finds ``./train.py`` whether
    the command runs as ``trainloop`` or ``python -m trainloop``.

    Args:
        spec: ``"package.module:ClassName"``.
        given_as: Where the spec came from, for messages (``--trainer``, ``run.yaml: trainer``).

    Raises:
        CliError: The spec is malformed, the module does not import (or exits while importing),
            the attribute is missing, or it is not a ``BaseTrainer`` subclass.
    """
    from trainloop.trainer import BaseTrainer  # torch: only once a trainer is named

    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name.strip() or not attribute.strip():
        raise CliError(f"{given_as} {spec!r}: expected module:Class (e.g. my_project.train:MyTrainer)")
    obj: Any = _import_module(module_name, spec, given_as)
    for part in attribute.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise CliError(f"{given_as} {spec!r}: {module_name!r} has no attribute {attribute!r}") from None
    if not isinstance(obj, type) or not issubclass(obj, BaseTrainer):
        raise CliError(f"{given_as} {spec!r}: {attribute} is not a subclass of trainloop.BaseTrainer")
    if obj is BaseTrainer:
        raise CliError(f"{given_as} {spec!r}: name your BaseTrainer subclass, not BaseTrainer itself")
    return obj
