"""The plain models every parallel version is compared against.

    config.py  GPTConfig and the closed-form parameter count (pure Python: no torch)
    gpt.py     the reference GPT (torch)
    moe.py     the mixture-of-experts layer that replaces a block's MLP when n_experts > 0
    moe_config.py  MoEGPTConfig: shared experts, sigmoid router, bias balancing, device-limited
               routing; fine_grained (DeepSeekMoE's split at equal active FLOPs)
    layers.py  the MLP and the attention core CausalAttention (q, k, v -> out), the submodule
               a sequence-splitting strategy swaps
"""

from course_lib._lazy import lazy_exports
from course_lib.model.config import ATTN_IMPLS, GPTConfig, expected_num_params

# The torch modules are imported on first use (PEP 562): `course_lib.model.config` (and so the
# estimator) must import where torch is not installed, and Python runs this file first.
_LAZY = {"GPT": "course_lib.model.gpt", "Block": "course_lib.model.gpt", "CausalSelfAttention": "course_lib.model.gpt",
         "sequence_positions": "course_lib.model.gpt", "CausalAttention": "course_lib.model.layers",
         "MLP": "course_lib.model.layers"}

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "CausalAttention", "MLP", "expected_num_params",
           "sequence_positions", "ATTN_IMPLS"]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY, globals())
