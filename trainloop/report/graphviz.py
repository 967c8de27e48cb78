"""Rendering DOT source with Graphviz's ``dot`` program, when it is installed."""

from __future__ import annotations

import shutil
import subprocess

__all__ = ["GraphvizError", "find_dot", "render_dot"]

INSTALL_HINT = (
    "install Graphviz (`apt-get install graphviz`, `conda install graphviz` or `brew install graphviz`)"
)


class GraphvizError(RuntimeError):
    """``dot`` is not installed, or it failed; the message says which and how to fix it."""


def find_dot() -> str:
    """The path of Graphviz's ``dot`` program.

    Raises:
        GraphvizError: It is not on ``PATH``.
    """
    dot = shutil.which("dot")
    if dot is None:
        raise GraphvizError(f"Graphviz's `dot` program is not on PATH: {INSTALL_HINT}")
    return dot


def render_dot(source: str, format: str) -> bytes:
    """Run ``dot -T<format>`` on DOT ``source`` and return its output.

    Raises:
        GraphvizError: ``dot`` is not installed, or it failed (its message is included).
    """
    dot = find_dot()
    result = subprocess.run([dot, f"-T{format}"], input=source.encode(), capture_output=True, check=False)
    if result.returncode != 0:
        message = result.stderr.decode(errors="replace").strip()
        raise GraphvizError(f"{dot} -T{format} failed (exit {result.returncode}): {message}")
    return result.stdout
