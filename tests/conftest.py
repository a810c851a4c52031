"""Fixtures and settings every test file shares.

One thread in the test process: the ranks started by run_on_ranks get their own share of the
cores, and a test process that used every core would slow them down (and make float results
depend on the machine's core count).
"""

import pytest
import torch

from course_lib.data import VOCAB_SIZE
from course_lib.model import GPTConfig

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def vocab_size() -> int:
    """The course alphabet's size: the vocabulary of every model trained on the course data."""
    return VOCAB_SIZE


@pytest.fixture(scope="session")
def tiny_config(vocab_size) -> GPTConfig:
    """The notebooks' small GPT (2 layers, d_model 64, 4 heads, context 64) on the course data."""
    return GPTConfig.tiny(vocab_size)
