"""The report's figures as PNG files (matplotlib, Agg; no display needed). Each function takes the
numbers already computed from the tables and writes one file; nothing is read from images here."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from operators.optional import require


def _pyplot():
    """matplotlib's pyplot on the Agg backend (the ``report`` extra); imported on first use."""
    require("matplotlib").use("Agg")
    return require("matplotlib.pyplot")

BAND_COLOURS = {"reject": "#d62728", "mid": "#2ca02c", "top": "#1f77b4"}


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def car_histogram(car_percent: np.ndarray, path: Path, title: str) -> Path:
    """Fig. 2: distribution of change area ratio, with mean and median marked."""
    fig, ax = _pyplot().subplots(figsize=(6.4, 3.6))
    ax.hist(car_percent, bins=np.linspace(0, 100, 41), color="#4c72b0", edgecolor="white")
    if len(car_percent):
        for value, style, name in ((np.mean(car_percent), "--", "mean"), (np.median(car_percent), ":", "median")):
            ax.axvline(value, color="black", linestyle=style, label=f"{name} {value:.1f}%")
        ax.legend()
    ax.set_xlabel("change area ratio (%)")
    ax.set_ylabel("image pairs")
    ax.set_title(title)
    return _save(fig, path)


def bar_chart(labels: list[str], counts: list[int], path: Path, title: str, xlabel: str = "",
              ylabel: str = "count", horizontal: bool = False, colour: str = "#4c72b0") -> Path:
    """Magnitude classes (Fig. 4 of the issue), question types (Fig. 8), reject reasons."""
    fig, ax = _pyplot().subplots(figsize=(6.4, max(3.0, 0.35 * len(labels) + 1.2) if horizontal else 3.6))
    total = max(sum(counts), 1)
    if horizontal:
        bars = ax.barh(labels[::-1], counts[::-1], color=colour)
        ax.set_xlabel(ylabel)
    else:
        bars = ax.bar(labels, counts, color=colour)
        ax.set_ylabel(ylabel)
        ax.set_xlabel(xlabel)
        _pyplot().setp(ax.get_xticklabels(), rotation=20, ha="right")
    for b, c in zip(bars, counts[::-1] if horizontal else counts):
        text = f"{c} ({100 * c / total:.0f}%)"
        if horizontal:
            ax.annotate(text, (b.get_width(), b.get_y() + b.get_height() / 2), xytext=(3, 0),
                        textcoords="offset points", va="center", fontsize=8)
        else:
            ax.annotate(text, (b.get_x() + b.get_width() / 2, b.get_height()), xytext=(0, 2),
                        textcoords="offset points", ha="center", fontsize=8)
    ax.set_title(title)
    ax.margins(x=0.15 if horizontal else 0.05, y=0.12)
    return _save(fig, path)


def score_histogram(scores: np.ndarray, path: Path, title: str, pass_score: float = 7.0) -> Path:
    """Figs. 4 and 7 of the paper: judge scores 1-10, rejected (< pass) red, 7-8 green, 9-10 blue."""
    fig, ax = _pyplot().subplots(figsize=(6.4, 3.6))
    values = np.arange(1, 11)
    rounded = np.clip(np.round(scores), 1, 10)
    counts = np.array([(rounded == v).sum() for v in values])
    colours = [BAND_COLOURS["reject"] if v < pass_score else BAND_COLOURS["top"] if v >= 9 else BAND_COLOURS["mid"]
               for v in values]
    ax.bar(values, counts, color=colours)
    ax.set_xticks(values)
    ax.set_xlabel("judge overall score")
    ax.set_ylabel("items")
    n = max(len(scores), 1)
    ax.set_title(f"{title}\n<{pass_score:g}: {100 * (scores < pass_score).sum() / n:.1f}%   "
                 f"{pass_score:g}-8: {100 * ((scores >= pass_score) & (scores < 9)).sum() / n:.1f}%   "
                 f"9-10: {100 * (scores >= 9).sum() / n:.1f}%", fontsize=10)
    return _save(fig, path)


def residual_histogram(residual_px: np.ndarray, accepted: np.ndarray, path: Path, max_residual_px: float | None) -> Path:
    """The pairs job's screening residuals, accepted and rejected slices stacked."""
    fig, ax = _pyplot().subplots(figsize=(6.4, 3.6))
    top = max(float(np.nanmax(residual_px)) if len(residual_px) else 1.0, max_residual_px or 0.0) * 1.05
    bins = np.linspace(0, max(top, 1e-3), 30)
    ax.hist([residual_px[accepted], residual_px[~accepted]], bins=bins, stacked=True,
            color=[BAND_COLOURS["mid"], BAND_COLOURS["reject"]], label=["accepted", "rejected"])
    if max_residual_px:
        ax.axvline(max_residual_px, color="black", linestyle="--", label=f"limit {max_residual_px:g} px")
    ax.set_xlabel("screening residual (px)")
    ax.set_ylabel("slices")
    ax.set_title("Registration residuals (pairs job)")
    ax.legend()
    return _save(fig, path)


def word_cloud(texts: list[str], path: Path, seed: int = 0) -> Path:
    """Fig. 5: word cloud of selected captions (the ``wordcloud`` package and the font it ships)."""
    wordcloud = require("wordcloud")
    STOPWORDS, WordCloud = wordcloud.STOPWORDS, wordcloud.WordCloud
    text = " ".join(texts).strip() or "no captions"
    cloud = WordCloud(width=900, height=450, background_color="white", stopwords=STOPWORDS | {"image"},
                      random_state=seed, collocations=True, max_words=150).generate(text)
    cloud.to_file(str(path))
    return path
