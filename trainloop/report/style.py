"""The report page's style sheet: plain CSS, inlined so the page stands alone."""

__all__ = ["STYLE"]

STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; color: #1f2328; margin: 0;
       background: #f6f8fa; }
main { max-width: 1180px; margin: 0 auto; padding: 24px; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 28px 0 10px; border-bottom: 1px solid #d0d7de; padding-bottom: 4px; }
h3 { font-size: 15px; margin: 16px 0 6px; }
.muted { color: #656d76; } .card { background: #fff; border: 1px solid #d0d7de; border-radius: 6px; padding: 12px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(440px, 1fr)); gap: 12px; }
.grid svg { width: 100%; height: auto; } .diagram svg { max-width: 100%; height: auto; }
.diagram { overflow-x: auto; text-align: center; }
table { border-collapse: collapse; background: #fff; }
td, th { border: 1px solid #d0d7de; padding: 3px 10px; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.bar { background: #54aeff; height: 10px; border-radius: 2px; }
.best { background: #dafbe1; font-weight: 600; } .bad { color: #cf222e; }
.stats { display: flex; gap: 12px; flex-wrap: wrap; } .stats .card { min-width: 130px; }
.stats b { display: block; font-size: 20px; }
pre { background: #fff; border: 1px solid #d0d7de; border-radius: 6px; padding: 10px; overflow-x: auto;
      font-size: 12px; }
"""
