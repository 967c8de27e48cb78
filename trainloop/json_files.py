"""The JSON files trainloop writes.

Strict JSON (no ``NaN`` or ``Infinity``, which other readers refuse), and JSON-lines appends that never join a line cut
short by a killed writer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

__all__ = ["append_line", "open_jsonl", "strict_json", "without_non_finite"]


def without_non_finite(value: Any) -> Any:
    """``value`` with every NaN or infinite float, however deep, replaced by ``None``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: without_non_finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [without_non_finite(v) for v in value]
    return value


def strict_json(value: Any, indent: int | None = None) -> str:
    """``value`` as strict JSON text: non-finite floats become ``null``."""
    return json.dumps(without_non_finite(value), indent=indent, allow_nan=False)


def open_jsonl(path: Path) -> IO[str]:
    """``path`` opened to append JSON lines, the first of them on a line of its own.

    A writer killed mid-line leaves a last line without its newline, which no reader can parse;
    appending after it would join the next record to it and lose both. That cut-off line is
    dropped first.
    """
    with path.open("a+b") as file:
        size = file.seek(0, 2)
        if size:
            file.seek(max(0, size - 65536))
            tail = file.read()
            if not tail.endswith(b"\n"):
                cut = tail.rfind(b"\n")
                file.truncate(size - len(tail) + cut + 1 if cut >= 0 else (0 if size <= 65536 else size))
    return path.open("a", encoding="utf-8")


def append_line(path: Path, line: str) -> None:
    """Append ``line`` (ending in a newline) to the JSON-lines file ``path`` (see ``open_jsonl``)."""
    with open_jsonl(path) as file:
        file.write(line)
