"""`SampleStats` from LLaVA / InternVL-style annotation files.

A record (one line of a ``.jsonl`` file, or one entry of a ``.json`` list)::

    {"id": "sample-1",                                  # optional; the sample key (else file + index)
     "image": "charts/a.png" | ["a.png", "b.png"],      # optional; paths relative to the image root
     "width": 800, "height": 600,                       # optional (lists for several images): skip the header read
     "conversations": [{"from": "human", "value": "<image>\\nWhat is shown?"},
                       {"from": "gpt", "value": "A bar chart."}]}

Per sample: ``tiles`` = InternVL dynamic-resolution tiles of every image (a text-only sample counts one
dummy tile unless ``count_dummy_tile=False``: InternVL still runs the encoder on it, and the published
statistics count it); ``tokens`` = text tokens of every turn (``<image>`` placeholders removed) plus, per
image, ``tokens_per_tile * tiles + image_marker_tokens``, plus the configured template overhead;
``images`` = number of images. Image sizes come from the file headers (no pixel decode) unless the record
gives them. A record without ``<image>`` placeholders but with images is accepted (InternVL prepends the
placeholder); a placeholder count other than 0 or the number of images is an error.

JSONL files are streamed line by line (memory stays flat); a JSON list is loaded whole, as JSON requires.
Chunks of records go to a pool of worker processes (``workers``), at most a few chunks in flight, results
kept in file order. Bad records raise :class:`InputError` naming the annotation file, the record
(``line N`` / ``index N``), the field and, for images, the image path; with ``on_error="skip"`` they are
dropped, counted and listed in the :class:`AnnotationReport`.
"""

from __future__ import annotations

import collections
import itertools
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from omnibal.errors import InputError
from omnibal.layout import OnError
from omnibal.processes import available_cores, start_method
from omnibal.stats.records import IMAGE_PLACEHOLDER, RecordError, check_inside, parse_json_line, parse_record
from omnibal.stats.table import ImageConvention, SampleStats, index_keys
from omnibal.stats.tiles import TileConfig, count_tiles, image_size
from omnibal.stats.tokens import ESTIMATE, TokenConfig, make_counter

__all__ = ["AnnotationConfig", "AnnotationReport", "IMAGE_PLACEHOLDER", "available_cores", "compute_stats",
           "iter_records", "record_keys"]
MAX_REPORTED_ERRORS = 20


@dataclass(frozen=True, kw_only=True)
class AnnotationConfig:
    """How annotation files become statistics."""

    image_root: str | None = None
    """Folder that image paths are relative to (unset: each annotation file's own folder)."""
    tokenizer: str | None = None
    """Local tokenizer (tokenizer.json or a folder) that counts the text tokens; unset: a labelled estimate
    from the characters (``omnibal stats --hf-model``: the checkpoint's own tokenizer)."""
    tiles: TileConfig = TileConfig()
    """InternVL dynamic-resolution settings."""
    tokens: TokenConfig = TokenConfig()
    """Image tokens per tile and template overhead."""
    count_dummy_tile: bool = field(default=True, metadata={"flag": "--dummy-tile"})
    """Text-only samples count the one dummy tile InternVL feeds the vision encoder (as the published
    statistics do); off: they count 0 tiles."""
    split_max_tiles: bool = False
    """Multi-image samples give each image ``max(1, max_tiles // num_images)`` tiles at most (InternVL2's
    multi-image rule); off: every image may use ``max_tiles``."""
    apply_exif: bool = field(default=True, metadata={"flag": "--exif"})
    """Images with EXIF orientation 5-8 have width and height swapped, as they are displayed; off: the raw
    header size, as InternVL's loader sees it."""
    allow_outside_root: bool = False
    """Accept image paths that lead outside the image root (``../``, absolute paths, symlinks pointing
    out). Refused by default: an annotation file from elsewhere should not make omnibal open any file."""
    workers: int = field(default=1, metadata={"cli_default": 0})
    """Worker processes: 1 counts in this process, 0 starts one per core this process may use."""
    chunk_size: int = 256
    """Records per task sent to a worker."""
    on_error: OnError = "raise"
    """Bad records: ``raise`` at the first, or ``skip`` them (counted and reported)."""
    progress: bool = field(default=False, metadata={"cli": False})
    """Show a progress bar on stderr (only when it is a terminal)."""

    def __post_init__(self) -> None:
        if self.on_error not in tuple(OnError):
            raise InputError(f"must be raise or skip, got {self.on_error!r}", source="on_error")
        if not 0 <= self.workers <= 1024:
            raise InputError(f"must be in [0, 1024], got {self.workers}", source="workers")
        if not 1 <= self.chunk_size <= 1 << 20:
            raise InputError(f"must be >= 1, got {self.chunk_size}", source="chunk_size")


@dataclass(frozen=True, kw_only=True)
class AnnotationReport:
    """What a run read, computed and skipped."""

    sources: tuple[str, ...]
    num_records: int
    num_loaded: int
    num_skipped: int
    errors: tuple[InputError, ...] = field(default=())
    """The first :data:`MAX_REPORTED_ERRORS` reasons for skipping, in file order."""
    token_count_method: str = ESTIMATE
    """``"tokenizer:<path>"`` or ``"estimate"``."""
    num_images: int = 0
    num_headers_read: int = 0
    """Images whose size came from the file header."""
    num_sizes_given: int = 0
    """Images whose size the record gave."""
    workers: int = 1
    seconds: float = 0.0
    """Wall time from opening the files to the finished table."""
    cpu_seconds: float | None = None
    """CPU time of this process and its worker processes over the run (None where unmeasurable): a
    figure that, unlike ``seconds``, does not depend on what else the machine is running."""

    def to_dict(self) -> dict:
        return {
            "sources": list(self.sources), "num_records": self.num_records, "num_loaded": self.num_loaded,
            "num_skipped": self.num_skipped, "errors": [str(e) for e in self.errors],
            "token_count_method": self.token_count_method, "num_images": self.num_images,
            "num_headers_read": self.num_headers_read, "num_sizes_given": self.num_sizes_given,
            "workers": self.workers, "seconds": round(self.seconds, 3),
            "cpu_seconds": None if self.cpu_seconds is None else round(self.cpu_seconds, 3),
        }  # fmt: skip

    def summary(self) -> str:
        rate = self.num_records / self.seconds if self.seconds > 0 else float("nan")
        lines = [
            f"read {self.num_records:,} records from {len(self.sources)} file(s) in {self.seconds:.2f} s "
            f"({rate:,.0f} samples/s, {self.workers} worker(s)"
            + ("" if self.cpu_seconds is None else f", {self.cpu_seconds:.2f} CPU s")
            + f"); {self.num_images:,} images "
            f"({self.num_headers_read:,} headers read, {self.num_sizes_given:,} sizes given); "
            f"tokens: {self.token_count_method}"
        ]
        if self.num_skipped:
            lines.append(f"skipped {self.num_skipped:,} invalid record(s):")
            lines += [f"  {e}" for e in self.errors]
            if self.num_skipped > len(self.errors):
                lines.append(f"  ... and {self.num_skipped - len(self.errors):,} more")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------- driver
def annotation_convention(config: AnnotationConfig) -> ImageConvention:
    """The image convention statistics made with ``config`` are in: one tile per image with the thumbnail off
    is LLaVA's single image (``omnibal stats --convention llava``, the HF Llava adapter), anything else
    InternVL's tiles; tokens per tile as configured."""
    single = config.tiles.max_tiles == 1 and not config.tiles.use_thumbnail and not config.split_max_tiles
    return ImageConvention("llava" if single else "internvl", config.tokens.tokens_per_tile)


def compute_stats(paths, config: AnnotationConfig = AnnotationConfig()) -> tuple[SampleStats, AnnotationReport]:
    """Statistics of every record of ``paths`` (one file or several, rows in file order)."""
    paths = [Path(paths)] if isinstance(paths, (str, os.PathLike)) else [Path(p) for p in paths]
    if not paths:
        raise InputError("no annotation files given", source="annotations")
    for p in paths:
        if not p.is_file():
            raise InputError("annotation file not found", source=str(p))
    if config.tokenizer is not None:
        make_counter(config.tokenizer)  # fail early, in this process, on a bad tokenizer path
    if config.workers == 0:
        config = replace(config, workers=available_cores())
    started = time.perf_counter()
    cpu_started = _cpu_time()
    parts, errors = [], []
    totals = collections.Counter()
    method = ESTIMATE
    pool = _LazyPool(config)
    try:
        with _progress(paths, config) as bar:
            for path in paths:
                chunks = _chunks(path, config.chunk_size)
                results = _run_chunks(pool, chunks, config)
                part, n_records = [], 0
                for res in results:
                    n_records += res.num_records
                    totals["records"] += res.num_records
                    method = res.method
                    totals.update(res.counts)
                    if res.errors:
                        if config.on_error == "raise":
                            raise res.errors[0][1]
                        errors += res.errors
                    part.append(res)
                    bar.update(res.num_records)
                if n_records == 0:
                    raise InputError("no records (empty annotation file)", source=str(path))
                parts.append(_assemble(path, part))
    finally:
        pool.close()  # joins the workers, so their CPU time is counted below
    num_records = totals.pop("records")
    if not any(len(p) for p in parts):
        first = errors[0][1] if errors else None
        raise InputError(f"no valid records ({len(errors)} skipped; first: {first})", source=str(paths[0]))
    stats = SampleStats.concat([p for p in parts if len(p)], source="+".join(str(p) for p in paths))
    stats = replace(stats, convention=annotation_convention(config))
    report = AnnotationReport(
        sources=tuple(str(p) for p in paths), num_records=num_records, num_loaded=len(stats),
        num_skipped=len(errors), errors=tuple(e for _, e in errors[:MAX_REPORTED_ERRORS]),
        token_count_method=method, num_images=totals["images"], num_headers_read=totals["headers"],
        num_sizes_given=totals["given"], workers=config.workers, seconds=time.perf_counter() - started,
        cpu_seconds=None if cpu_started is None else _cpu_time() - cpu_started,
    )  # fmt: skip
    return stats, report


def _cpu_time() -> float | None:
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _assemble(path: Path, results) -> SampleStats:
    def cat(name, dtype):
        arrays = [getattr(r, name) for r in results]
        return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)

    keys = record_keys(path.name, cat("index", np.int64), cat("id_keys", np.uint64), cat("has_id", bool))
    return SampleStats(
        tiles=cat("tiles", np.int64), tokens=cat("tokens", np.int64), images=cat("images", np.int64),
        keys=keys, source=str(path),
    )  # fmt: skip


class _LazyPool:
    """Worker processes, started only when a file has more than one chunk of work."""

    def __init__(self, config: AnnotationConfig) -> None:
        self.config, self.pool = config, None

    def get(self):
        if self.pool is None:
            self.pool = _make_pool(self.config)
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


def _run_chunks(lazy_pool: _LazyPool, chunks, config: AnnotationConfig):
    """Results of every chunk in order; a pool keeps at most ``2 * workers`` chunks in flight."""
    chunks = iter(chunks)
    head = list(itertools.islice(chunks, 2))
    if config.workers == 1 or len(head) < 2:  # one chunk: not worth starting processes
        _init_worker(config)
        for chunk in itertools.chain(head, chunks):
            yield _process_chunk(chunk)
        return
    pool = lazy_pool.get()
    window = collections.deque()
    for chunk in itertools.chain(head, chunks):
        window.append(pool.apply_async(_process_chunk, (chunk,)))
        if len(window) >= 2 * config.workers:
            yield window.popleft().get()
    while window:
        yield window.popleft().get()


def _make_pool(config: AnnotationConfig):
    # this process has used no tokenizer threads yet (it only loaded the tokenizer to check it): forking is safe
    ctx = multiprocessing.get_context(start_method())
    return ctx.Pool(config.workers, initializer=_init_worker, initargs=(config,))


class _progress:
    def __init__(self, paths, config: AnnotationConfig) -> None:
        self.enabled = config.progress and sys.stderr.isatty()
        self.paths = paths
        self.bar = None

    def __enter__(self):
        if self.enabled:
            total = sum(_count_records(p) for p in self.paths)
            self.bar = tqdm(total=total, unit="sample", file=sys.stderr, desc="omnibal stats")
        return self

    def update(self, n: int) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()


def _count_records(path: Path) -> int | None:
    if path.suffix.lower() != ".jsonl":
        return None
    n = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            n += block.count(b"\n")
    return n


# --------------------------------------------------------------------------------------------- reading
def _chunks(path: Path, chunk_size: int):
    """``(source, root, items)`` tasks; items are ``(locator, index, payload)`` with payload a raw line
    (bytes, parsed in the worker) or an already parsed record."""
    source = str(path)
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        items, index = [], 0
        with open(path, "rb") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                items.append((f"line {lineno}", index, line))
                index += 1
                if len(items) == chunk_size:
                    yield (source, items)
                    items = []
        if items:
            yield (source, items)
        return
    if path.suffix.lower() != ".json":
        raise InputError("annotation files must be .json (a list) or .jsonl (one record per line)", source=source)
    try:
        records = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text (byte {exc.start})", source=source) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"malformed JSON: {exc.msg} (column {exc.colno})", source=source,
                         record=f"line {exc.lineno}") from None  # fmt: skip
    except (ValueError, RecursionError) as exc:
        raise InputError(f"malformed JSON: {exc}", source=source) from None
    if not isinstance(records, list):
        raise InputError(f"expected a JSON list of records, got {type(records).__name__}", source=source)
    for start in range(0, len(records), chunk_size):
        yield (source, [(f"index {i}", i, r) for i, r in enumerate(records[start : start + chunk_size], start)])


def iter_records(path: str | os.PathLike):
    """``(locator, index, payload)`` of every record of one annotation file in file order: the reader
    ``omnibal stats`` uses, for whoever needs the records themselves (the training dataset). ``payload`` is
    a raw JSONL line (bytes: parse it with :func:`omnibal.stats.records.parse_json_line`) or a parsed record."""
    for _, items in _chunks(Path(path), 4096):
        yield from items


def record_keys(file_name: str, indices: np.ndarray, id_keys: np.ndarray, has_id: np.ndarray) -> np.ndarray:
    """The sample key of each record: its ``id`` hashed with the file name, else the file name and its index
    among the file's records (independent of the folder, so a moved file keeps its keys)."""
    indices = np.asarray(indices, np.int64)
    if len(indices) == 0:
        return np.zeros(0, np.uint64)
    by_index = index_keys(file_name, int(indices.max()) + 1)[indices]
    return np.where(np.asarray(has_id, bool), np.asarray(id_keys, np.uint64), by_index)


# --------------------------------------------------------------------------------------------- workers
_STATE: dict = {}


def _init_worker(config: AnnotationConfig) -> None:
    if config.workers > 1 and "TOKENIZERS_PARALLELISM" not in os.environ:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    if _STATE.get("config") != config:
        _STATE["config"] = config
        _STATE["counter"] = make_counter(config.tokenizer)


@dataclass
class _ChunkResult:
    num_records: int
    index: np.ndarray
    tiles: np.ndarray
    tokens: np.ndarray
    images: np.ndarray
    id_keys: np.ndarray
    has_id: np.ndarray
    errors: list
    counts: dict
    method: str


def _process_chunk(task) -> _ChunkResult:
    source, items = task
    config: AnnotationConfig = _STATE["config"]
    root = config.image_root if config.image_root else os.path.dirname(source)
    real_root = os.path.realpath(root)
    real_dirs: dict[str, str] = {}
    file_name = os.path.basename(source)
    errors, parsed = [], []
    counts = collections.Counter()
    for locator, index, payload in items:
        try:
            rec = parse_json_line(payload) if isinstance(payload, bytes) else payload
            p = parse_record(rec, file_name)
            sizes = []
            for k, img in enumerate(p["images"]):
                given = p["sizes"][k] if p["sizes"] else None
                path = os.path.join(root, img)  # an absolute img replaces the root, as InternVL's loader does
                if not config.allow_outside_root:
                    check_inside(path, img, real_root, real_dirs, source, locator)
                if given is None:
                    sizes.append(image_size(path, source=source, record=locator, apply_exif=config.apply_exif))
                else:
                    sizes.append(given)
        except RecordError as exc:
            errors.append((index, InputError(exc.message, source=source, record=locator, field=exc.field)))
            continue
        except InputError as exc:
            errors.append((index, exc))
            continue
        counts["headers"] += len(p["images"]) - (len(p["images"]) if p["sizes"] else 0)
        counts["given"] += len(p["images"]) if p["sizes"] else 0
        counts["images"] += len(p["images"])
        parsed.append((index, locator, p, sizes))
    n = len(parsed)
    tiles = np.zeros(n, np.int64)
    images = np.array([len(p["images"]) for _, _, p, _ in parsed], dtype=np.int64)
    # tiles: one vectorised rule call per distinct images-per-sample count (max tiles may be split)
    for num in np.unique(images[images > 0]).tolist():
        rows = np.flatnonzero(images == num)
        wh = np.array([s for r in rows.tolist() for s in parsed[r][3]], dtype=np.int64).reshape(-1, 2)
        tcfg = config.tiles
        if config.split_max_tiles and num > 1:
            cap = max(1, tcfg.max_tiles // num)
            tcfg = TileConfig(min_tiles=min(tcfg.min_tiles, cap), max_tiles=cap, tile_size=tcfg.tile_size,
                              use_thumbnail=tcfg.use_thumbnail)  # fmt: skip
        tiles[rows] = count_tiles(wh[:, 0], wh[:, 1], tcfg).astype(np.int64).reshape(-1, num).sum(axis=1)
    if config.count_dummy_tile:
        tiles[images == 0] = 1
    # text: every turn of every record in one batch
    turns = [t for _, _, p, _ in parsed for t in p["texts"]]
    num_turns = np.array([len(p["texts"]) for _, _, p, _ in parsed], dtype=np.int64)
    per_turn = _STATE["counter"].count(turns)
    text = np.add.reduceat(per_turn, np.concatenate([[0], np.cumsum(num_turns)[:-1]])) if n else per_turn
    tc = config.tokens
    tokens = (
        text + num_turns * tc.tokens_per_turn + tc.tokens_per_sample
        + tiles * tc.tokens_per_tile * (images > 0) + images * tc.image_marker_tokens
    )  # fmt: skip
    # a sample must stay representable: flag absurd ones as errors rather than failing the whole table
    keep = np.ones(n, dtype=bool)
    for r in np.flatnonzero((tokens < 1) | (tokens > (1 << 24)) | (tiles > 4096)).tolist():
        index, locator, _, _ = parsed[r]
        what = ("no tokens (empty conversation)" if tokens[r] < 1
                else f"absurd size: {tiles[r]} tiles, {tokens[r]} tokens")
        errors.append((index, InputError(what, source=source, record=locator, field="conversations")))
        keep[r] = False
    errors.sort(key=lambda e: e[0])
    return _ChunkResult(
        num_records=len(items), index=np.array([i for i, _, _, _ in parsed], dtype=np.int64)[keep],
        tiles=tiles[keep], tokens=tokens[keep], images=images[keep],
        id_keys=np.array([p["key"] or 0 for _, _, p, _ in parsed], dtype=np.uint64)[keep],
        has_id=np.array([p["key"] is not None for _, _, p, _ in parsed], dtype=bool)[keep],
        errors=errors, counts=dict(counts), method=_STATE["counter"].method,
    )  # fmt: skip
