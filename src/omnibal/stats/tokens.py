"""Text token counts: a Hugging Face tokenizer from a local path, or a clearly labelled estimate.

Only local files are read (no hub access): a ``tokenizer.json`` file, or a folder holding one (both via the
``tokenizers`` library, fast and light), or any other tokenizer folder that ``transformers``'
``AutoTokenizer`` can load with ``local_files_only=True``.

Without a tokenizer the count is an estimate: ``ceil(ascii_chars / 4) + non_ascii_chars`` (English BPE
vocabularies average about four characters per token; CJK text is close to one token per character).
Results made that way say ``token_count_method = "estimate"`` and the CLI warns.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from omnibal.errors import InputError

ESTIMATE = "estimate"
MIN_VOCAB = 32  # a real tokenizer has at least its byte alphabet; 1 means a silently broken load


class TokenCounter:
    """Counts tokens of many texts at once; ``method`` says how (``"tokenizer:<path>"`` or ``"estimate"``)."""

    method: str = ESTIMATE

    def count(self, texts: list[str]) -> np.ndarray:
        raise NotImplementedError


class EstimateCounter(TokenCounter):
    """``ceil(ascii / 4) + non_ascii`` characters: a labelled estimate, not a tokenizer."""

    method = ESTIMATE

    def count(self, texts: list[str]) -> np.ndarray:
        out = np.empty(len(texts), dtype=np.int64)
        for i, text in enumerate(texts):
            ascii_len = len(text.encode("ascii", "ignore"))
            out[i] = -(-ascii_len // 4) + (len(text) - ascii_len)
        return out


class HFTokenCounter(TokenCounter):
    """Exact counts with a local Hugging Face tokenizer (special tokens not added: the chat template's
    own tokens are accounted for separately)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = str(path)
        self.method = f"tokenizer:{self.path}"
        self._fast, self._auto = _load(Path(path))
        size = self.vocab_size
        if size < MIN_VOCAB:
            raise InputError(
                f"tokenizer has a vocabulary of {size} tokens; the files did not load as intended",
                source=self.path, field="tokenizer",
            )  # fmt: skip

    @property
    def vocab_size(self) -> int:
        if self._fast is not None:
            return int(self._fast.get_vocab_size(with_added_tokens=True))
        return len(self._auto)

    def encode(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids of ``text`` (no special tokens added) and the character offset where each starts: what
        a training sample is built from, with the same tokenizer the counts come from."""
        if self._fast is not None:
            enc = self._fast.encode(text, add_special_tokens=False)
            return list(enc.ids), [s for s, _ in enc.offsets]
        enc = self._auto(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [s for s, _ in enc["offset_mapping"]]

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token`` in the vocabulary (added tokens included), None when it has none."""
        if self._fast is not None:
            return self._fast.token_to_id(token)
        return self._auto.get_vocab().get(token)

    def added_token_ids(self) -> set[int]:
        """Ids of the tokens added on top of the learned vocabulary (special tokens such as ``<image>``)."""
        if self._fast is not None:
            return set(self._fast.get_added_tokens_decoder())
        return set(self._auto.added_tokens_decoder)

    def id_to_token(self, token_id: int) -> str | None:
        if self._fast is not None:
            return self._fast.id_to_token(int(token_id))
        return self._auto.convert_ids_to_tokens(int(token_id)) if 0 <= token_id < len(self._auto) else None

    def count(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros(0, dtype=np.int64)
        if self._fast is not None:
            encodings = self._fast.encode_batch(texts, add_special_tokens=False)
            return np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(texts))
        ids = self._auto(texts, add_special_tokens=False)["input_ids"]
        return np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(texts))


def _load(path: Path):
    if not path.exists():
        raise InputError("tokenizer path does not exist", source=str(path), field="tokenizer")
    file = path / "tokenizer.json" if path.is_dir() else path
    if file.is_file() and file.suffix == ".json":
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise InputError("reading a tokenizer needs the Hugging Face `tokenizers` package, which the plain "
                             "install leaves out: pip install 'omnibal[hf]'", source=str(path),
                             field="tokenizer") from None

        try:
            return Tokenizer.from_file(str(file)), None
        except Exception as exc:  # the library raises bare Exceptions for malformed files
            raise InputError(f"not a tokenizer.json: {exc}", source=str(file), field="tokenizer") from None
    if path.is_dir():
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise InputError(
                "this tokenizer folder needs the transformers package (pip install 'omnibal[hf]')",
                source=str(path), field="tokenizer",
            ) from None  # fmt: skip
        try:
            return None, AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:
            raise InputError(f"cannot load a tokenizer from this folder: {exc}", source=str(path),
                             field="tokenizer") from None  # fmt: skip
    raise InputError("expected a tokenizer.json file or a tokenizer folder", source=str(path), field="tokenizer")


def make_counter(tokenizer: str | os.PathLike | None) -> TokenCounter:
    """A counter for ``tokenizer`` (a local path), or the estimate when it is None."""
    return EstimateCounter() if tokenizer is None else HFTokenCounter(tokenizer)


@dataclass(frozen=True, kw_only=True)
class TokenConfig:
    """How a sample's LLM sequence length is put together."""

    tokens_per_tile: int = 256
    """LLM tokens per vision tile (InternVL: 256 after pixel shuffle; LLaVA-1.5: 576 per image)."""
    image_marker_tokens: int = 2
    """Tokens around each image's tokens (InternVL's ``<img>`` and ``</img>``)."""
    tokens_per_turn: int = 0
    """Chat-template tokens added per conversation turn (role markers, separators); 0 counts the text
    only. InternLM2's template, for example, adds about 5 per turn."""
    tokens_per_sample: int = 0
    """Tokens added once per sample (a system prompt, BOS)."""

    def __post_init__(self) -> None:
        for name in ("tokens_per_tile", "image_marker_tokens", "tokens_per_turn", "tokens_per_sample"):
            value = getattr(self, name)
            if not 0 <= value <= 1 << 16:
                raise InputError(f"must be in [0, 65536], got {value}", source="TokenConfig", field=name)
