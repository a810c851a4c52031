"""The small model and training settings both ZeRO test files use (tests/test_zero.py,
tests/test_zero_per_param.py): a parameter count that no world size of 2, 3 or 4 divides, so
every test meets a padded last shard."""

from course_lib.data import CharDataset
from course_lib.model import GPT, GPTConfig
from course_lib.train import TrainConfig

STEPS = 3


def uneven_config() -> GPTConfig:
    c = GPTConfig.tiny(CharDataset("train").vocab_size, n_layer=3, d_ff=127, block_size=32)
    n = GPT(c).num_params()
    assert n % 2 and n % 3 and n % 4, f"{n} parameters: the test needs uneven shards at N = 2, 3, 4"
    return c


def train_cfg(clip=0.0, lr=3e-3) -> TrainConfig:
    return TrainConfig(steps=STEPS, batch_size=12, lr=lr, grad_clip=clip, eval_every=10**6, progress=False)
