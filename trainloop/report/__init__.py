"""``trainloop report``: one self-contained HTML page about a run's workspace (``page``), its metric
charts (``charts``) and the machine drawn with Graphviz where it is installed (``graphviz``)."""

from trainloop.report.page import REPORT_FILE, ReportError, build_report, machine_svg, write_report

__all__ = ["REPORT_FILE", "ReportError", "build_report", "machine_svg", "write_report"]
