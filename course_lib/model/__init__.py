"""The plain models every parallel version is compared against.

    gpt.py     GPTConfig, the reference GPT and its closed-form parameter count
    moe.py     the mixture-of-experts layer that replaces a block's MLP when n_experts > 0
    moe_config.py  MoEGPTConfig: shared experts, sigmoid router, bias balancing, device-limited
               routing; fine_grained (DeepSeekMoE's split at equal active FLOPs)
    layers.py  the MLP and the attention core CausalAttention (q, k, v -> out), the submodule
               a sequence-splitting strategy swaps
"""

from course_lib.model.gpt import (ATTN_IMPLS, GPT, Block, CausalSelfAttention, GPTConfig, expected_num_params,
                                  sequence_positions)
from course_lib.model.layers import MLP, CausalAttention

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "CausalAttention", "MLP", "expected_num_params",
           "sequence_positions", "ATTN_IMPLS"]
