"""A small real example set the project makes itself (``make_examples.py``): images, annotations, tokenizer.

``ANNOTATIONS`` (LLaVA/InternVL-style JSONL) references the images under ``images/`` relative to
``EXAMPLES_DIR``; ``TOKENIZER`` is a byte-level BPE tokenizer trained on local text (vocabulary 2048).
Regenerate with ``python -m omnibal.examples.make_examples`` (deterministic).
"""

from __future__ import annotations

from pathlib import Path

EXAMPLES_DIR = Path(__file__).resolve().parent
ANNOTATIONS = EXAMPLES_DIR / "annotations.jsonl"
IMAGES_DIR = EXAMPLES_DIR / "images"
TOKENIZER = EXAMPLES_DIR / "tokenizer.json"

__all__ = ["ANNOTATIONS", "EXAMPLES_DIR", "IMAGES_DIR", "TOKENIZER"]
