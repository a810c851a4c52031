"""Tests for course_lib.data: corpus, tokenizer, deterministic split, windows, batches."""

import pytest
import torch
from torch.utils.data import DistributedSampler

import hashlib

from course_lib.data import (ALPHABET, OOV, TEXT_PATH, VOCAB_SIZE, CharDataset, CharTokenizer, encoded_text,
                             get_batch, load_text)

TEXT_SHA256_PREFIX = "71f2ff5d99bdc1f9"


def test_text_is_pinned_and_real():
    text = load_text()
    assert len(text) == 465_126  # the shipped file, whatever Python runs the course
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == TEXT_SHA256_PREFIX
    assert "def " in text and "class" in text
    assert (TEXT_PATH.parent / "LICENSE-python-docs.txt").exists()  # shipped with its licence


def test_fixed_alphabet_round_trip_and_oov():
    tok = CharTokenizer()
    assert tok.vocab_size == VOCAB_SIZE == 97 and tok.chars[0] == "\n" and tok.chars[-1] == OOV
    text = load_text()
    sample = "".join(ch for ch in text[1000:3000] if ch in ALPHABET)
    assert len(sample) > 1900
    ids = tok.encode(sample)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == sample
    assert tok.decode(torch.tensor(ids)) == sample  # tensors work too
    assert tok.encode("a\u2014b\t") == [tok.stoi["a"], tok.oov_id, tok.stoi["b"], tok.oov_id]
    assert tok.decode(tok.encode("é")) == OOV
    with pytest.raises(ValueError, match="OOV"):
        CharTokenizer("abc")


def test_split_is_deterministic_and_disjoint():
    train = CharDataset("train", block_size=64)
    val = CharDataset("val", block_size=64)
    _, tokens = encoded_text()
    n = len(tokens)
    assert (train.start, train.stop) == (0, int(n * 0.9))
    assert (val.start, val.stop) == (int(n * 0.9), n)
    assert train.stop <= val.start  # no token belongs to both splits
    # The last train window ends inside the train range, the first val window starts in val.
    x, y = train[len(train) - 1]
    assert torch.equal(y, tokens[train.stop - 64 : train.stop])
    x, _ = val[0]
    assert torch.equal(x, tokens[val.start : val.start + 64])
    again = CharDataset("train", block_size=64)
    assert len(again) == len(train) and torch.equal(again[123][0], train[123][0])


def test_xy_shift_and_dtype():
    ds = CharDataset("val", block_size=16)
    x, y = ds[5]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16,)
    assert torch.equal(x[1:], y[:-1])  # y is x shifted left by one
    assert torch.equal(y, ds.data[6:22])
    assert len(ds) == len(ds.data) - 16
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_items_are_copies_not_views_of_cache():
    ds = CharDataset("train", block_size=8)
    x, _ = ds[0]
    before = encoded_text()[1][0].item()
    x[0] = before + 1
    assert encoded_text()[1][0].item() == before


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(split="test"), "split='test'"),
        (dict(block_size=0), "block_size=0"),
        (dict(block_size=10**7), "too large"),
        (dict(val_fraction=0.0), "val_fraction=0.0"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CharDataset(**kwargs)


def test_get_batch_deterministic():
    ds = CharDataset("train", block_size=32)
    x1, y1 = get_batch(ds, 8, torch.Generator().manual_seed(0))
    x2, y2 = get_batch(ds, 8, torch.Generator().manual_seed(0))
    x3, _ = get_batch(ds, 8, torch.Generator().manual_seed(1))
    assert x1.shape == y1.shape == (8, 32)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)
    assert torch.equal(x1[:, 1:], y1[:, :-1])


def test_works_with_distributed_sampler():
    ds = CharDataset("val", block_size=32)
    shards = [list(DistributedSampler(ds, num_replicas=4, rank=r, shuffle=False)) for r in range(4)]
    seen = [i for shard in shards for i in shard]
    assert set(seen) == set(range(len(ds)))  # every window covered exactly by the shards
    assert len(seen) - len(ds) < 4  # padding repeats at most num_replicas - 1 indices
    x, y = ds[shards[2][0]]
    assert x.shape == (32,)
