"""A self-contained HTML report directory: ``index.html`` plus its images as PNG files beside it
(``img/``), so a browser opens it offline and a test can check that every image it references exists
and decodes. Figures are drawn with matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

import numpy as np

STYLE = """
body { font-family: sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 0.9em; }
td, th { border: 1px solid #bbb; padding: 3px 7px; text-align: right; }
th { background: #eee; }
.fail { background: #fdd; } .pass { background: #dfd; }
.grid td { text-align: center; vertical-align: top; font-size: 0.8em; }
.grid img { image-rendering: pixelated; width: 128px; height: 128px; }
.grid img.strip { width: auto; height: 256px; }
img.plot { max-width: 900px; }
"""


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported on first use; it takes a second)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """First frame of a Frames.array (frames, H, W, 3) in [0, 1] as (H, W, 3) uint8."""
    return (np.clip(frames[0], 0, 1) * 255).round().astype("uint8")


def heatmap(a: np.ndarray, b: np.ndarray, vmax: float | None = None) -> np.ndarray:
    """|a - b| of two Frames.arrays (max over channels) through the 'magma' colour map, as uint8 RGB.
    The scale is [0, vmax] (default: the largest difference, at least 1/255)."""
    plt = pyplot()
    diff = np.abs(a[0].astype(np.float64) - b[0].astype(np.float64)).max(axis=-1)
    vmax = vmax or max(float(diff.max()), 1 / 255)
    rgba = plt.get_cmap("magma")(np.clip(diff / vmax, 0, 1))
    return (rgba[..., :3] * 255).round().astype("uint8")


class Page:
    """Sections of one report; ``write`` puts ``index.html`` and ``img/*.png`` into ``out_dir``."""

    def __init__(self, out_dir: str | Path, title: str):
        self.dir = Path(out_dir)
        (self.dir / "img").mkdir(parents=True, exist_ok=True)
        self.title = title
        self.parts: list[str] = []
        self.images: list[str] = []  # relative paths of every image written

    def heading(self, text: str, level: int = 2) -> None:
        self.parts.append(f"<h{level}>{html.escape(text)}</h{level}>")

    def text(self, text: str) -> None:
        self.parts.append(f"<p>{html.escape(text)}</p>")

    def image(self, name: str, rgb: np.ndarray, alt: str = "") -> str:
        """Save an (H, W, 3) uint8 image; returns its <img> tag."""
        from PIL import Image

        rel = f"img/{name}.png"
        Image.fromarray(rgb).save(self.dir / rel)
        self.images.append(rel)
        return f'<img src="{rel}" alt="{html.escape(alt or name)}">'

    def figure(self, name: str, fig) -> None:
        rel = f"img/{name}.png"
        fig.savefig(self.dir / rel, dpi=90, bbox_inches="tight")
        pyplot().close(fig)
        self.images.append(rel)
        self.parts.append(f'<img class="plot" src="{rel}" alt="{html.escape(name)}">')

    def table(self, header: Sequence[str], rows: Sequence[Sequence], classes: Sequence[str] | None = None) -> None:
        head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
        body = []
        for i, row in enumerate(rows):
            cls = f' class="{classes[i]}"' if classes and classes[i] else ""
            body.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
        self.parts.append(f"<table><tr>{head}</tr>{''.join(body)}</table>")

    def grid(self, header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
        """A table whose cells are raw HTML (image tags from ``image``, with captions)."""
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
        self.parts.append(f'<table class="grid"><tr>{head}</tr>{body}</table>')

    def write(self) -> Path:
        doc = (
            f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(self.title)}</title>'
            f"<style>{STYLE}</style></head><body><h1>{html.escape(self.title)}</h1>"
            + "\n".join(self.parts)
            + "</body></html>\n"
        )
        path = self.dir / "index.html"
        path.write_text(doc)
        return path


def fmt(v, spec: str = ".2f") -> str:
    """A number for a table cell: inf as '∞' (identical images), None as 'n/a'."""
    if v is None:
        return "n/a"
    if isinstance(v, float) and np.isinf(v):
        return "∞"
    return format(v, spec)
