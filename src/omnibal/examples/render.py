"""Images for the real example (``omnibal example``): matplotlib charts and Pillow document pages whose
questions are answered from what was drawn, at sizes chosen so InternVL's tile rule varies."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

MIN_SIDE, DPI = 64, 100

# (width/height ratio, long side range in px, weight). Tiles at max 6: a near-square image gets 1 tile when
# small (< 2 tile areas: 64 px tiles up to 90 px, 56 px tiles up to 79 px) else 2x2 + thumbnail = 5; ratio
# 1.5 -> 7, 2 -> 3, 3 -> 4, 4 -> 5, 5 -> 6, 6 -> 7 (the same for the inverse ratios).
SHAPES = {
    "chart": ((1.0, 64, 88, 3), (1.0, 120, 480, 2), (1.5, 160, 640, 3), (2.0, 128, 640, 3), (3.0, 192, 640, 2),
              (4.0, 256, 640, 1), (5.0, 320, 640, 1), (6.0, 384, 640, 1)),
    "pie": ((1.0, 64, 88, 2), (1.0, 120, 400, 2), (1.5, 160, 480, 1)),
    "page": ((1.0, 64, 88, 2), (0.707, 128, 640, 3), (0.5, 128, 640, 2), (1 / 3, 192, 640, 2), (0.25, 256, 640, 1),
             (0.2, 320, 640, 1), (4.0, 256, 640, 1)),
}  # fmt: skip
CATEGORIES = {
    "city": "Oslo Lima Cairo Delhi Quito Perth Accra Riga Hanoi Bern Dakar Tokyo".split(),
    "fruit": "apple pear plum kiwi mango lemon fig grape cherry melon".split(),
    "team": "Red Blue Green Gold Black White Silver Orange".split(),
    "month": "Jan Feb Mar Apr May Jun Jul Aug Sep Oct Nov Dec".split(),
    "store": "north south east west central harbor airport station".split(),
}
METRICS = ("sales", "visitors", "rainfall", "score", "revenue", "orders", "downloads", "votes", "output")
WORDS = (
    "the a of and to in is was for on with as by at from this that it are be or an which one all were "
    "data chart table figure page report summary section result value total average rate growth share "
    "market energy water river city station train bridge road field garden forest mountain valley island "
    "north south east west early late new old small large high low first second third final next last "
    "measure record sample count increase decrease rise fall change remain reach show compare include "
    "during after before between under over across within around since until while because although "
    "year month week day morning evening winter summer spring autumn season period time hour minute "
    "people team group school museum library market harbor farm factory office store hospital theater "
    "blue green red yellow orange purple silver golden bright dark quiet busy careful simple clear open "
    "study plan project model system process method test review update budget price cost profit loss"
).split()


# one rendered image: its path (relative to the image root), kind, title and question/answer pool
Drawn = collections.namedtuple("Drawn", "path kind title qa")


def pick_size(rng: np.random.Generator, shape_kind: str) -> tuple[int, int]:
    """``(width, height)``: a shape of ``SHAPES[shape_kind]``, its ratio jittered by up to 5%."""
    shapes = SHAPES[shape_kind]
    weights = np.array([s[3] for s in shapes], dtype=np.float64)
    ratio, low, high, _ = shapes[int(rng.choice(len(shapes), p=weights / weights.sum()))]
    ratio *= float(rng.uniform(0.95, 1.05))
    long = int(rng.integers(low, high + 1))
    short = max(MIN_SIDE, round(long / max(ratio, 1 / ratio)))
    return (long, short) if ratio >= 1 else (short, long)


def render(kind: str, rng: np.random.Generator, images_dir: Path, stem: str) -> Drawn:
    """Draw one image of ``kind`` (bar, line, pie, page) under ``images_dir``."""
    rel = f"{'pages' if kind == 'page' else 'charts'}/{kind}-{stem}.png"
    size = pick_size(rng, "page" if kind == "page" else "pie" if kind == "pie" else "chart")
    draw = {"bar": bar_chart, "line": line_chart, "pie": pie_chart, "page": document_page}[kind]
    title, qa = draw(rng, size, images_dir / rel)
    return Drawn(rel, kind, title, qa)


# -- charts (matplotlib, without pyplot) -----------------------------------------------------------------
def _figure(size: tuple[int, int]):
    # heavy (~0.5 s): only the plots need it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] / DPI, size[1] / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    fontsize = float(np.clip(min(size) / 22, 3.5, 10))
    ax = fig.add_subplot()
    fig.subplots_adjust(left=0.12, right=0.97, bottom=0.16, top=0.84)
    ax.tick_params(labelsize=fontsize)
    return fig, ax, fontsize


def _save_figure(fig, size: tuple[int, int], path: Path) -> None:
    fig.canvas.draw()
    img = Image.fromarray(np.asarray(fig.canvas.buffer_rgba())).convert("RGB")
    if img.size != size:
        img = img.resize(size, Image.Resampling.BICUBIC)
    img.save(path)


def _labels(rng: np.random.Generator, low: int, high: int) -> tuple[str, list[str], str]:
    dim = list(CATEGORIES)[int(rng.integers(len(CATEGORIES)))]
    names = CATEGORIES[dim]
    n = int(rng.integers(low, min(high, len(names)) + 1))
    picked = sorted(rng.choice(len(names), size=n, replace=False))  # months stay in calendar order
    return dim, [names[int(k)] for k in picked], str(METRICS[int(rng.integers(len(METRICS)))])


def bar_chart(rng: np.random.Generator, size: tuple[int, int], path: Path) -> tuple[str, list]:
    """A bar chart with its values written on the bars; questions about values, labels and extremes."""
    dim, labels, metric = _labels(rng, 3, 7)
    values = [int(v) for v in rng.choice(np.arange(5, 100), size=len(labels), replace=False)]
    title = f"{metric.capitalize()} by {dim}"
    fig, ax, fs = _figure(size)
    bars = ax.bar(labels, values, color=f"C{int(rng.integers(10))}")
    ax.bar_label(bars, fontsize=fs)
    ax.set_title(title, fontsize=fs * 1.2)
    _save_figure(fig, size, path)
    hi, lo = int(np.argmax(values)), int(np.argmin(values))
    k = len(labels) // 2
    ranked = sorted(zip(values, labels), reverse=True)
    described = ", ".join(f"{lab} at {v}" for lab, v in zip(labels, values))
    return title, [
        (f"Which {dim} has the highest {metric}?", f"{labels[hi]}, with {values[hi]}."),
        (f"Which {dim} has the lowest {metric}?", f"{labels[lo]}."),
        (f"What is the {metric} of {labels[k]}?", f"{values[k]}."),
        ("How many bars does the chart show?", f"{len(labels)}."),
        ("What is the title of the chart?", f"{title}."),
        ("What is the difference between the highest and the lowest bar?", f"{values[hi] - values[lo]}."),
        ("List the bars from highest to lowest.", ", ".join(f"{lab} ({v})" for v, lab in ranked) + "."),
        ("Describe the chart in detail.",
         f"This bar chart, titled \"{title}\", compares the {metric} of {len(labels)} entries: {described}. "
         f"The highest is {labels[hi]} with {values[hi]} and the lowest is {labels[lo]} with {values[lo]}, "
         f"a difference of {values[hi] - values[lo]}."),
    ]  # fmt: skip


def line_chart(rng: np.random.Generator, size: tuple[int, int], path: Path) -> tuple[str, list]:
    """A line over consecutive years, each point labelled with its value."""
    n = int(rng.integers(4, 10))
    years = list(range(start := int(rng.integers(1995, 2016)), start + n))
    values = [int(v) for v in rng.choice(np.arange(10, 100), size=n, replace=False)]
    metric = str(METRICS[int(rng.integers(len(METRICS)))])
    title = f"{metric.capitalize()} per year"
    fig, ax, fs = _figure(size)
    ax.plot(years, values, marker="o", markersize=fs / 2, color=f"C{int(rng.integers(10))}")
    for x, y in zip(years, values):
        ax.annotate(str(y), (x, y), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=fs)
    ax.set_xticks(years, [str(y) for y in years], rotation=45 if n > 6 else 0)
    ax.set_ylim(0, 110)
    ax.set_title(title, fontsize=fs * 1.2)
    _save_figure(fig, size, path)
    hi, lo = int(np.argmax(values)), int(np.argmin(values))
    k = len(years) // 2
    way = "up" if values[k] > values[k - 1] else "down"
    points = ", ".join(f"{y}: {v}" for y, v in zip(years, values))
    return title, [
        (f"In which year is the {metric} highest?", f"{years[hi]}, at {values[hi]}."),
        (f"In which year is the {metric} lowest?", f"{years[lo]}."),
        (f"What is the value in {years[k]}?", f"{values[k]}."),
        (f"Did the {metric} go up or down from {years[k - 1]} to {years[k]}?",
         f"It went {way}, from {values[k - 1]} to {values[k]}."),
        ("How many years does the chart cover?", f"{len(years)} years, {years[0]} to {years[-1]}."),
        ("What is the title of the chart?", f"{title}."),
        ("Describe the trend.",
         f"The line chart \"{title}\" shows the {metric} from {years[0]} to {years[-1]}: {points}. It peaks in "
         f"{years[hi]} at {values[hi]} and is lowest in {years[lo]} at {values[lo]}."),
    ]  # fmt: skip


def pie_chart(rng: np.random.Generator, size: tuple[int, int], path: Path) -> tuple[str, list]:
    """A pie of whole-number percentages (they add up to 100, each one written on its slice)."""
    dim, labels, metric = _labels(rng, 3, 6)
    while True:
        cuts = np.sort(rng.choice(np.arange(4, 97), size=len(labels) - 1, replace=False))
        shares = [int(s) for s in np.diff(np.concatenate([[0], cuts, [100]]))]
        if min(shares) >= 3 and len(set(shares)) == len(shares):
            break
    title = f"Share of {metric} by {dim}"
    fig, ax, fs = _figure(size)
    ax.pie(shares, labels=labels, autopct=lambda p: f"{round(p)}%", textprops={"fontsize": fs})
    ax.set_title(title, fontsize=fs * 1.2)
    _save_figure(fig, size, path)
    big = int(np.argmax(shares))
    k = len(labels) // 2
    listed = ", ".join(f"{lab} {s}%" for lab, s in zip(labels, shares))
    return title, [
        ("Which slice is the largest?", f"{labels[big]}, with {shares[big]}%."),
        (f"What share does {labels[k]} have?", f"{shares[k]}%."),
        ("How many slices are there?", f"{len(labels)}."),
        ("What is the title of the chart?", f"{title}."),
        ("Describe the pie chart.", f"The pie chart \"{title}\" splits the {metric} between {len(labels)} "
                                    f"parts: {listed}. The largest part is {labels[big]}."),
    ]  # fmt: skip


# -- document pages (Pillow) ------------------------------------------------------------------------
def _fit(draw, words: list, font, width: int) -> str:
    """The longest prefix of ``words`` that fits ``width`` pixels (a first word that is too long is cut)."""
    text = ""
    for w in words:
        longer = f"{text} {w}" if text else w
        if draw.textlength(longer, font=font) > width:
            break
        text = longer
    if not text:
        text = words[0]
        while len(text) > 1 and draw.textlength(text, font=font) > width:
            text = text[:-1]
    return text


def document_page(rng: np.random.Generator, size: tuple[int, int], path: Path) -> tuple[str, list]:
    """A page with a title and a few lines of text (Pillow's default font)."""
    w, h = size
    fs = int(np.clip(round(min(w, h * 0.7) / 26), 7, 16))
    font, title_font = ImageFont.load_default(size=fs), ImageFont.load_default(size=round(fs * 1.4))
    img = Image.new("RGB", size, tuple(int(c) for c in rng.integers(235, 256, size=3)))
    draw = ImageDraw.Draw(img)
    margin, line_h = max(2, w // 24), round(fs * 1.3)
    avail = w - 2 * margin
    title_words = [str(x).capitalize() for x in rng.choice(WORDS, size=int(rng.integers(2, 5)))]
    title = _fit(draw, title_words, title_font, avail)
    draw.text((margin, margin), title, fill=(10, 10, 10), font=title_font)
    top = margin + round(fs * 1.4 * 1.5)
    room = max(1, (h - top - margin) // line_h)
    lines = []
    for k in range(min(room, int(rng.integers(2, 19)))):
        words = [str(x) if rng.random() > 0.1 else str(int(rng.integers(2, 999))) for x in rng.choice(WORDS, size=14)]
        lines.append(_fit(draw, words, font, avail))
        draw.text((margin, top + k * line_h), lines[-1], fill=(40, 40, 40), font=font)
    img.save(path)
    k = int(rng.integers(len(lines)))
    return title, [
        ("What is the title of the page?", f"The title is \"{title}\"."),
        ("How many lines of text are below the title?", f"{len(lines)}."),
        (f"What does line {k + 1} say?", f"Line {k + 1} says: {lines[k]}"),
        ("What is the first word of the last line?", f"{lines[-1].split()[0]}."),
        ("Transcribe the page.", "\n".join([title, *lines])),
        *([("Read the first two lines.", "\n".join(lines[:2]))] if len(lines) > 1 else []),
    ]  # fmt: skip


def pair_qa(first: Drawn, second: Drawn) -> list:
    """Questions about two images: each image's own questions, named by position, plus both titles."""
    qa = [("What are the titles of the two images?",
           f"The first is \"{first.title}\" and the second is \"{second.title}\".")]
    for name, drawn in (("first", first), ("second", second)):
        qa += [(f"In the {name} image: {q[0].lower()}{q[1:]}", a) for q, a in drawn.qa[:4]]
    return qa


def text_qa(rng: np.random.Generator) -> list:
    """Text-only questions (arithmetic, sorting, spelling) with computed answers."""
    a, b = (int(x) for x in rng.integers(2, 500, size=2))
    nums = [int(x) for x in rng.integers(1, 100, size=int(rng.integers(3, 9)))]
    word = str(rng.choice([w for w in WORDS if len(w) > 3]))
    sentence = " ".join(str(x) for x in rng.choice(WORDS, size=int(rng.integers(4, 16))))
    return [
        (f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."),
        (f"What is {a} times 3?", f"{3 * a}."),
        ("Sort these numbers from smallest to largest: " + ", ".join(map(str, nums)) + ".",
         ", ".join(map(str, sorted(nums))) + "."),
        (f"Spell the word \"{word}\" backwards.", f"{word[::-1]}."),
        (f"How many words are in this sentence: \"{sentence}\"?", f"{len(sentence.split())}."),
    ]  # fmt: skip
