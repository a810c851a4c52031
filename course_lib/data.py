"""Character-level text data that needs no download.

The corpus is the Python documentation's "topics" (about 454 KiB of real English and code),
pinned as a file shipped with the package (`course_lib/assets/python_doc_topics.txt`, from
CPython 3.11.7, under the Python licence next to it). Pinned rather than read from the
running Python, whose copy differs between versions: the text, the vocabulary, and so every
split, batch and loss, are the same on every machine.

The vocabulary is a fixed alphabet, not the set of characters that happen to occur:

    ALPHABET = "\n" + the 95 printable ASCII characters (space to "~") + OOV
    VOCAB_SIZE = 97

Any other character (a few typographic dashes and quotes in the text, anything a learner
types) is encoded as the out-of-vocabulary symbol OOV ("\ufffd", shown as a replacement
character when decoded).

    text --CharTokenizer--> tokens (int64, N)
    tokens[:n_train]  -> "train"   with n_train = int(N * (1 - val_fraction))
    tokens[n_train:]  -> "val"

A sample i of a split with tokens s is the window
    x = s[i : i + block_size],   y = s[i + 1 : i + block_size + 1]
i.e. y[t] is the next character after x[t], for every position t.
"""

from __future__ import annotations

import pathlib
from functools import lru_cache

import torch
from torch.utils.data import Dataset

from course_lib._validate import check_int

SPLITS = ("train", "val")
TEXT_PATH = pathlib.Path(__file__).resolve().parent / "assets" / "python_doc_topics.txt"
OOV = "\ufffd"
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127)) + OOV
VOCAB_SIZE = len(ALPHABET)  # 97


@lru_cache(maxsize=1)
def load_text() -> str:
    """The whole corpus as one string (the pinned file, identical everywhere)."""
    return TEXT_PATH.read_text(encoding="utf-8")


class CharTokenizer:
    """id = position of the character in ALPHABET; characters outside it become OOV."""

    def __init__(self, alphabet: str = ALPHABET):
        if len(set(alphabet)) != len(alphabet) or OOV not in alphabet:
            raise ValueError("alphabet must list distinct characters and include OOV")
        self.chars = list(alphabet)
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        self.oov_id = self.stoi[OOV]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> list[int]:
        return [self.stoi.get(ch, self.oov_id) for ch in s]

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


# Module-level cache: encoding 465K characters takes a noticeable fraction of a
# second, and tests/notebooks build many datasets. Treat the tensor as read-only.
_TOKENIZER: CharTokenizer | None = None
_TOKENS: torch.Tensor | None = None


def encoded_text() -> tuple[CharTokenizer, torch.Tensor]:
    """(tokenizer, int64 tensor of the whole corpus), computed once per process."""
    global _TOKENIZER, _TOKENS
    if _TOKENS is None:
        _TOKENIZER = CharTokenizer()
        _TOKENS = torch.tensor(_TOKENIZER.encode(load_text()), dtype=torch.int64)
    return _TOKENIZER, _TOKENS


class CharDataset(Dataset):
    """Map-style dataset of (x, y) next-character windows from one split.

    Being a plain map-style dataset (`__len__` + `__getitem__`) it works with
    DataLoader and DistributedSampler unchanged.
    """

    def __init__(self, split: str = "train", block_size: int = 64, val_fraction: float = 0.1):
        if split not in SPLITS:
            raise ValueError(f"split={split!r} must be one of {SPLITS}")
        check_int("block_size", block_size)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction!r} must satisfy 0 < val_fraction < 1")
        self.tokenizer, tokens = encoded_text()
        n_train = int(len(tokens) * (1.0 - val_fraction))
        # [start, stop) of this split inside the full token stream.
        self.start, self.stop = (0, n_train) if split == "train" else (n_train, len(tokens))
        self.data = tokens[self.start : self.stop]  # a view, no copy
        if len(self.data) < block_size + 1:
            raise ValueError(
                f"block_size={block_size} is too large for the {split} split "
                f"({len(self.data)} tokens; need at least block_size + 1)"
            )
        self.split = split
        self.block_size = block_size
        self.val_fraction = val_fraction

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def __len__(self) -> int:
        # Window i needs tokens i .. i + block_size (inclusive) for x and y.
        return len(self.data) - self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for dataset of length {len(self)}")
        i = i % len(self)
        chunk = self.data[i : i + self.block_size + 1]
        return chunk[:-1].clone(), chunk[1:].clone()  # clone: never hand out views of the cache


def sample_indices(dataset_len: int, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """batch_size random window indices in [0, dataset_len), with replacement.
    Split out so data-parallel code can draw the *global* batch's indices with
    the same generator as the reference and then take its own shard."""
    return torch.randint(dataset_len, (batch_size,), generator=generator)


def collate(dataset, indices) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack dataset[i] for i in indices into (x, y) of shape (len(indices), block_size)."""
    pairs = [dataset[int(i)] for i in indices]
    return torch.stack([x for x, _ in pairs]), torch.stack([y for _, y in pairs])


def get_batch(dataset, batch_size: int, generator: torch.Generator):
    """A random batch (x, y), each (batch_size, block_size) int64. Deterministic
    given the generator's state; the global RNG is not used."""
    return collate(dataset, sample_indices(len(dataset), batch_size, generator))
