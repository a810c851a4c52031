"""ParallelDims: the degrees of one run, validated once in the parent before any rank starts.

    world_size = pp * dp * ep * tp          (mesh order ("pp", "dp", "ep", "tp"), tp innermost)

What each dimension splits (B = global batch, L = layers, E = experts):

    tp   the weights of every matrix (heads, d_ff, vocabulary); with sequence parallelism also
         the activations along the sequence outside attention/MLP
    pp   the layers: pp * virtual_stages stages of about L / (pp * v) blocks each
    dp   the batch: B / (dp * ep) rows per replica; with zero=1 also the optimizer state
    ep   the experts: E / ep per rank; the batch too (an ep rank is also a data replica)

Two options act on every rank alike: precision "bf16" (matmuls under torch.autocast, the
parameters and so the optimizer's master weights stay fp32) and activation_checkpointing
(every block recomputes its forward in backward).

Each rule below is one ValueError naming the value and the rule (torchtitan's ParallelDims
does the same job).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from course_lib._validate import check_int
from course_lib.parallel.mesh import MESH_DIMS

ZERO_STAGES = (0, 1)  # 2 and 3 reduce (or gather) inside backward, once per micro-batch: not composed here
PRECISIONS = ("fp32", "bf16")  # bf16: torch.autocast around forward and backward, fp32 parameters (master weights)


@dataclass(frozen=True)
class ParallelDims:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    virtual_stages: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    sequence_parallel: bool = False
    precision: str = "fp32"  # PRECISIONS; the single-process twin (train_single) takes the same
    activation_checkpointing: bool = False  # recompute every block's forward in backward

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.ep * self.tp

    @property
    def replicas(self) -> int:
        """How many different shares of the batch there are: dp * ep."""
        return self.dp * self.ep

    def sizes(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in MESH_DIMS}

    def as_dict(self) -> dict:
        return asdict(self)

    def check(self, world_size: int | None, model_config, batch_size: int,
              seq_len: int | None = None) -> "ParallelDims":
        """Every rule of a hybrid run (see the module docstring); returns self.
        world_size None: the product of the degrees (the parent launching that many ranks)."""
        for name in ("dp", "tp", "pp", "ep", "virtual_stages", "microbatches"):
            check_int(name, getattr(self, name))
        world_size = self.world_size if world_size is None else world_size
        check_int("zero", self.zero, minimum=0)
        if self.zero not in ZERO_STAGES:
            raise ValueError(f"zero={self.zero} must be one of {ZERO_STAGES}: stages 2 and 3 act inside backward, "
                             f"once per pipeline micro-batch, and are not composed with the other dimensions here")
        for name in ("sequence_parallel", "activation_checkpointing"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r} must be one of {PRECISIONS}")
        if self.world_size != world_size:
            raise ValueError(f"pp*dp*ep*tp = {self.pp}*{self.dp}*{self.ep}*{self.tp} = {self.world_size} "
                             f"must equal world_size={world_size}")
        cfg = model_config
        seq = cfg.block_size if seq_len is None else seq_len
        if self.tp > 1 and cfg.n_experts:
            raise ValueError(f"tp={self.tp} with n_experts={cfg.n_experts}: tensor parallelism here splits the "
                             f"dense GPT only; give an MoE model tp=1 and split its experts with ep")
        for name, value in (("n_head", cfg.n_head), ("d_model", cfg.d_model), ("d_ff", cfg.ff_dim)):
            if value % self.tp:
                raise ValueError(f"tp={self.tp} must divide {name}={value}")
        if self.sequence_parallel:
            if self.tp == 1:
                raise ValueError("sequence_parallel=True needs tp > 1: it splits the sequence over the tp ranks")
            if self.pp > 1:
                raise ValueError(f"sequence_parallel=True with pp={self.pp}: the pipeline sends whole-sequence "
                                 f"activations between stages; use sequence parallelism with pp=1")
            if seq % self.tp:
                raise ValueError(f"sequence length {seq} must be divisible by tp={self.tp} under sequence parallelism")
        if self.ep > 1:
            if not cfg.n_experts:
                raise ValueError(f"ep={self.ep} needs an MoE model: n_experts=0 is dense")
            if cfg.n_experts % self.ep:
                raise ValueError(f"ep={self.ep} must divide n_experts={cfg.n_experts}: every rank holds "
                                 f"n_experts / ep whole experts")
        if cfg.n_experts and self.pp > 1 and (cfg.aux_loss_coef or cfg.z_loss_coef or cfg.capacity_factor):
            raise ValueError(f"pp={self.pp} with an MoE model needs aux_loss_coef=0, z_loss_coef=0 and "
                             f"capacity_factor=None: the pipeline's last stage computes only the cross-entropy, "
                             f"and capacity would depend on the micro-batch")
        if self.virtual_stages > 1 and self.pp == 1:
            raise ValueError(f"virtual_stages={self.virtual_stages} needs pp > 1")
        if cfg.n_layer < self.pp * self.virtual_stages:
            raise ValueError(f"n_layer={cfg.n_layer} must be >= pp * virtual_stages = {self.pp}*{self.virtual_stages}"
                             f" = {self.pp * self.virtual_stages}: every stage needs at least one block")
        check_int("batch_size", batch_size)
        if batch_size % self.replicas:
            raise ValueError(f"batch_size={batch_size} must be divisible by dp*ep = {self.replicas}: "
                             f"every replica takes an equal share")
        share = batch_size // self.replicas
        if share % self.microbatches:
            raise ValueError(f"microbatches={self.microbatches} must divide the per-replica batch "
                             f"batch_size/(dp*ep) = {share}")
        if self.pp > 1:
            from course_lib.parallel.pp import make_schedule

            make_schedule(self.schedule, self.pp, self.microbatches, self.virtual_stages)
        return self
