"""``trainloop report``: one self-contained HTML page about a run's workspace.

The page (``page``), its run facts (``facts``), its metric charts, one per family (``charts``), and its
machine section (``machine``: drawn in Python, or with Graphviz on request, ``graphviz``); the metrics a
run logged (``metrics.jsonl``) read back with ``read_metrics``.
"""

from trainloop.core.metrics import read_metrics
from trainloop.report.page import ReportError, build_report, write_report

__all__ = ["ReportError", "build_report", "read_metrics", "write_report"]
