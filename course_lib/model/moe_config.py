"""The frontier mixture-of-experts options (notebook 07, sections 11-15), as a GPTConfig with more fields.

    MoEGPTConfig(..., n_shared_experts, router, balance, bias_rate, expert_groups, max_groups_per_token)
    MoEGPTConfig.from_config(config, **changes)   a GPTConfig with the new fields set
    fine_grained(config, m, n_shared)   the DeepSeekMoE split of a coarse MoE at equal FLOPs

A plain GPTConfig has none of these fields and the MoE layer (moe.py) then uses their defaults,
so every existing model computes exactly as before. The rules themselves are in moe.py's docstring:

    n_shared_experts   S      MLPs every token passes through (Dai et al. 2024)
    router                    "softmax" (Switch, GShard) or "sigmoid" (DeepSeek-V3)
    balance                   "aux": the Switch loss; "bias": auxiliary-loss-free balancing
                              (Wang et al. 2024) with step size bias_rate = gamma; "none"
    expert_groups      G      contiguous groups of n_experts / G experts (one per EP rank)
    max_groups_per_token M    each token's experts come from at most M groups (DeepSeek-V2/V3)

Fine-grained experts (DeepSeekMoE §3.1-3.2): split each of E experts of hidden size f into m
experts of hidden f/m, choose m*k of them, and turn S of the chosen into shared experts:

    routed experts  E*m - S,  top_k  k*m - S,  hidden  f/m,  shared  S
    active expert matmul weights per token: (k*m - S + S) * 2 d f/m = k * 2 d f   (the coarse MoE's)
    total expert weights: (E*m - S + S) * 2 d f/m = E * 2 d f                     (the coarse MoE's)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from course_lib._validate import check_int
from course_lib.model.gpt import GPTConfig
from course_lib.model.moe import BALANCES, ROUTERS


@dataclass(frozen=True)
class MoEGPTConfig(GPTConfig):
    n_shared_experts: int = field(default=0, repr=False)
    router: str = field(default="softmax", repr=False)
    balance: str = field(default="aux", repr=False)
    bias_rate: float = field(default=1e-3, repr=False)  # gamma of the bias update
    expert_groups: int = field(default=1, repr=False)
    max_groups_per_token: int | None = field(default=None, repr=False)

    @classmethod
    def from_config(cls, config: GPTConfig, **changes) -> "MoEGPTConfig":
        """`config`'s fields (a GPTConfig's or another MoEGPTConfig's) with `changes`."""
        return cls(**{**{k: getattr(config, k) for k in config.__dataclass_fields__}, **changes})

    def __repr__(self):
        return "MoEGPTConfig" + super().__repr__()[len("GPTConfig"):]

    def __post_init__(self):
        super().__post_init__()
        if not self.n_experts:
            raise ValueError("n_experts=0 is a dense model: MoEGPTConfig needs n_experts > 0")
        check_int("n_shared_experts", self.n_shared_experts, minimum=0)
        if self.router not in ROUTERS:
            raise ValueError(f"router={self.router!r} must be one of {ROUTERS}")
        if self.balance not in BALANCES:
            raise ValueError(f"balance={self.balance!r} must be one of {BALANCES}")
        if isinstance(self.bias_rate, bool) or not isinstance(self.bias_rate, (int, float)) or not self.bias_rate >= 0:
            raise ValueError(f"bias_rate={self.bias_rate!r} must be a number >= 0")
        G, M = self.expert_groups, self.max_groups_per_token
        rule = f"a positive int dividing n_experts={self.n_experts}"
        if self.n_experts % check_int("expert_groups", G, rule=rule):
            raise ValueError(f"expert_groups={G!r} must be {rule}")
        if M is not None:
            check_int("max_groups_per_token", M, maximum=G, rule=f"an int in [1, expert_groups={G}]: a token "
                                                                  f"cannot use more expert-parallel ranks than there are")
            if M * (self.n_experts // G) < self.top_k:
                raise ValueError(f"max_groups_per_token={M} groups of {self.n_experts // G} experts hold fewer "
                                 f"than top_k={self.top_k} experts: M * n_experts / expert_groups must be >= top_k")


def fine_grained(config: GPTConfig, m: int, n_shared: int = 0, **overrides) -> MoEGPTConfig:
    """The coarse MoE `config` (E experts, top-k, hidden f) as E*m - S experts of hidden f/m, top
    k*m - S, plus S shared (module docstring): the same active and total expert weights."""
    if not config.n_experts:
        raise ValueError("config must be an MoE (n_experts > 0) to split its experts")
    rule = f"a positive int dividing the expert hidden size {config.ff_dim}"
    if config.ff_dim % check_int("m", m, rule=rule):
        raise ValueError(f"m={m!r} must be {rule}")
    check_int("n_shared", n_shared, minimum=0, maximum=config.top_k * m - 1,
              rule=f"an int in [0, top_k * m = {config.top_k * m}): at least one expert must stay routed")
    return MoEGPTConfig.from_config(config, n_experts=config.n_experts * m - n_shared, top_k=config.top_k * m - n_shared,
                                    d_ff=config.ff_dim // m, n_shared_experts=n_shared, **overrides)
