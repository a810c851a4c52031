"""The plain models every parallel version is compared against.

    gpt.py   GPTConfig, the reference GPT and its closed-form parameter count
"""

from course_lib.model.gpt import ATTN_IMPLS, GPT, MLP, Block, CausalSelfAttention, GPTConfig, expected_num_params

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP", "expected_num_params", "ATTN_IMPLS"]
