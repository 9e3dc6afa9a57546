"""Test equipment: open a page in Debian's headless Chromium, take a screenshot, and report which of its
images loaded.

The page is loaded into an iframe of a small probe page (``--allow-file-access-from-files`` lets a
``file://`` page read another's DOM); after the load event the probe writes, for every ``<img>``, whether
it decoded (``complete`` and ``naturalWidth > 0``) into its own DOM, which ``--dump-dom`` prints."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

PROBE = """<!DOCTYPE html><html><body>
<iframe id="page" src="{src}" style="width:1200px;height:900px"></iframe>
<pre id="result">pending</pre>
<script>
window.addEventListener("load", function () {{
  var doc = document.getElementById("page").contentDocument;
  var imgs = Array.prototype.slice.call(doc.images).map(function (im) {{
    return {{alt: im.alt, ok: im.complete && im.naturalWidth > 0, w: im.naturalWidth, h: im.naturalHeight,
             src: im.currentSrc.slice(0, 40)}};
  }});
  document.getElementById("result").textContent = "RESULT" + JSON.stringify({{
    images: imgs, text_chars: doc.body.innerText.length, tables: doc.querySelectorAll("table").length}}) + "END";
}});
</script></body></html>"""

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--allow-file-access-from-files",
         "--no-first-run", "--disable-dev-shm-usage"]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def probe_page(page: Path, workdir: Path, timeout_s: float = 180) -> dict:
    """``{"images": [{alt, ok, w, h}], "text_chars", "tables"}`` as Chromium saw ``page``."""
    probe = workdir / "probe.html"
    probe.write_text(PROBE.format(src=page.resolve().as_uri()))
    out = subprocess.run([chromium(), *FLAGS, "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()],
                         capture_output=True, text=True, timeout=timeout_s)
    m = re.search(r"RESULT(.*?)END", out.stdout, re.S)
    if not m:
        raise RuntimeError(f"no probe result from chromium (exit {out.returncode}): {out.stderr[-1500:]}")
    return json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))


def screenshot(page: Path, png: Path, width: int = 1200, height: int = 3000, timeout_s: float = 180) -> Path:
    subprocess.run([chromium(), *FLAGS, f"--screenshot={png}", f"--window-size={width},{height}",
                    page.resolve().as_uri()], capture_output=True, timeout=timeout_s, check=True)
    return png
