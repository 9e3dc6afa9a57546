"""``index.html``: one self-contained page with the report's tables, figures and a gallery of sample
pairs. Self-contained means *embedded*: every figure and thumbnail is a ``data:`` URI, so the single file
can be copied, mailed or attached anywhere and still shows everything (the PNG figures are also written
next to it for reuse). Thumbnails are small (``gallery_side`` px) to keep the page light."""
from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field

import numpy as np

from operators.llm.images import data_url, fit_max_side
from operators.report.stats import Table

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0 auto;max-width:1100px;padding:16px 24px;color:#222}
h1{margin-bottom:4px} .sub{color:#666;margin-top:0}
table{border-collapse:collapse;margin:8px 0 20px} th,td{border:1px solid #ccc;padding:4px 10px;text-align:right}
th:first-child,td:first-child{text-align:left} th{background:#f2f2f2}
figure{display:inline-block;margin:8px 12px 16px 0;vertical-align:top} figure img{max-width:520px;border:1px solid #ddd}
figcaption{font-size:13px;color:#555;max-width:520px}
.card{border:1px solid #ddd;border-radius:6px;padding:10px;margin:12px 0}
.triplet{display:flex;gap:8px;flex-wrap:wrap} .triplet div{text-align:center;font-size:12px;color:#555}
.triplet img{width:192px;height:auto;border:1px solid #ccc;image-rendering:pixelated}
.card ul{margin:6px 0 0 18px;padding:0} .meta{color:#666;font-size:13px}
nav a{margin-right:12px}
"""


@dataclass
class Figure:
    key: str
    title: str
    png: bytes
    caption: str = ""


@dataclass
class GalleryItem:
    pair_id: str
    meta: str
    images: dict[str, np.ndarray | None]          # "pre", "post", "mask" -> RGB or grey uint8
    captions: list[str] = field(default_factory=list)
    qa: list[tuple[str, str]] = field(default_factory=list)


def data_uri_png(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def thumbnail_url(image: np.ndarray, side: int) -> str:
    """Photos as JPEG (a tenth of PNG's size), masks (2-D) as lossless PNG, longer side at most ``side``."""
    small = fit_max_side(image, side, nearest=image.ndim == 2)
    return data_url(small, "jpeg" if image.ndim == 3 else "png", jpeg_quality=88)


def table_html(t: Table) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in t.columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in t.rows)
    return f'<h3 id="t-{t.key}">{html.escape(t.title)}</h3>\n<table><tr>{head}</tr>{body}</table>'


def figure_html(f: Figure) -> str:
    return (f'<figure id="f-{f.key}"><img src="{data_uri_png(f.png)}" alt="{html.escape(f.title)}">'
            f'<figcaption><b>{html.escape(f.title)}</b> {html.escape(f.caption)}</figcaption></figure>')


def gallery_html(items: list[GalleryItem], side: int) -> str:
    cards = []
    for it in items:
        cells = []
        for key, label in (("pre", "before (A)"), ("post", "after (B)"), ("mask", "change mask")):
            img = it.images.get(key)
            if img is None:
                cells.append(f"<div>{label}: not available</div>")
            else:
                cells.append(f'<div><img class="gallery" src="{thumbnail_url(img, side)}" '
                             f'alt="{html.escape(it.pair_id)} {label}"><br>{label}</div>')
        texts = ""
        if it.captions:
            texts += "<b>Selected captions</b><ul>" + "".join(f"<li>{html.escape(c)}</li>" for c in it.captions) + "</ul>"
        if it.qa:
            texts += "<b>Selected QA</b><ul>" + "".join(
                f"<li><i>{html.escape(q)}</i> — {html.escape(a)}</li>" for q, a in it.qa) + "</ul>"
        cards.append(f'<div class="card"><b>{html.escape(it.pair_id)}</b> <span class="meta">{html.escape(it.meta)}</span>'
                     f'<div class="triplet">{"".join(cells)}</div>{texts}</div>')
    return "\n".join(cards)


def render_page(title: str, subtitle: str, sections: list[tuple[str, str, list[Table], list[Figure]]],
                gallery: list[GalleryItem], gallery_side: int = 192) -> str:
    """``sections``: (anchor, heading, tables, figures); sections without content are left out."""
    parts, nav = [], []
    for anchor, heading, tables, figures in sections:
        if not tables and not figures:
            continue
        nav.append(f'<a href="#{anchor}">{html.escape(heading)}</a>')
        parts.append(f'<section id="{anchor}"><h2>{html.escape(heading)}</h2>'
                     + "\n".join(table_html(t) for t in tables) + "\n" + "\n".join(figure_html(f) for f in figures)
                     + "</section>")
    if gallery:
        nav.append('<a href="#gallery">Sample pairs</a>')
        parts.append(f'<section id="gallery"><h2>Sample pairs</h2>{gallery_html(gallery, gallery_side)}</section>')
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1><p class=\"sub\">{html.escape(subtitle)}</p>"
            f"<nav>{''.join(nav)}</nav>\n" + "\n".join(parts) + "\n</body></html>\n")
