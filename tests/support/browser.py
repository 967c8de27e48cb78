"""Headless Chromium for the tests: a page laid out by a real browser, its text measured there."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--no-first-run", "--hide-scrollbars",
]

# Each matched element's text, its font size as drawn (the computed size times the SVG's scale on
# screen) and its box, written into the page for --dump-dom to return.
_MEASURE = """<script>
const found = [...document.querySelectorAll(%s)].map(t => {
  const box = t.getBoundingClientRect(), m = t.getScreenCTM ? t.getScreenCTM() : null;
  const scale = m ? Math.hypot(m.a, m.b) : 1;
  return {text: t.textContent, size: parseFloat(getComputedStyle(t).fontSize) * scale,
          x: box.left, y: box.top, w: box.width, h: box.height};
});
const pre = document.createElement("pre"); pre.id = "measured"; pre.textContent = JSON.stringify(found);
document.body.appendChild(pre);
</script>"""


def run(args: list[str], profile: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Chromium with the tests' flags and a fresh profile."""
    assert CHROMIUM is not None
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


def measure_text(page: str, selector: str, directory: Path, width: int = 1000) -> list[dict[str, object]]:
    """The elements ``selector`` matches in ``page`` (HTML) as laid out in a ``width`` px window."""
    file = directory / "measured.html"
    file.write_text(page.replace("</body>", _MEASURE % json.dumps(selector) + "</body>"), encoding="utf-8")
    result = run([f"--window-size={width},1200", "--dump-dom", file.as_uri()], directory / "profile")
    assert result.returncode == 0, result.stderr[-2000:]
    found = re.search(r'<pre id="measured">(.*?)</pre>', result.stdout, re.S)
    assert found is not None, result.stdout[-2000:]
    import html

    return json.loads(html.unescape(found.group(1)))


def overlapping(boxes: list[dict[str, object]], slack: float = 0.5) -> list[tuple[str, str]]:
    """The pairs of measured boxes that overlap by more than ``slack`` px both ways."""
    pairs = []
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            ax, ay, aw, ah = (float(a[k]) for k in "xywh")  # type: ignore[arg-type]
            bx, by, bw, bh = (float(b[k]) for k in "xywh")  # type: ignore[arg-type]
            if min(ax + aw, bx + bw) - max(ax, bx) > slack and min(ay + ah, by + bh) - max(ay, by) > slack:
                pairs.append((str(a["text"]), str(b["text"])))
    return pairs
