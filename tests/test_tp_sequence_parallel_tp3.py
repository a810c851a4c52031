"""Tensor parallelism with sequence parallelism at tp = 3, sequence length 12.

The rule is T % tp == 0 for the WHOLE sequence (12 % 3 == 0). The layers used to check the
column-parallel layer's input against tp too, but under sequence parallelism that input is this
rank's shard, T/tp = 4 tokens, and 4 % 3 != 0: a valid layout raised "sequence length 4 must be
divisible by tp=3". Here it trains like one process, and a mutant that puts the old check back
shows this test reaches that path.

The model has n_head = 3, d_model = 48 and d_ff = 192, all divisible by 3; the vocabulary (97
symbols) is padded to 99 rows at tp = 3.
"""

import sys
from unittest import mock

import cloudpickle
import pytest
import torch

from course_lib import RankError, run_on_ranks
from course_lib.data import CharDataset
from course_lib.model import GPT, GPTConfig
from course_lib.parallel.tp import ColumnParallelLinear, apply_tensor_parallel
from course_lib.parallel.tp.training import train_tensor_parallel
from course_lib.train import TrainConfig, flat_grads, flat_params, train_reference

from _tolerances import adamw_loss_atol, assert_adamw_params_close, assert_grads_close_after_adamw, by_name

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # rank processes cannot import this file
torch.set_num_threads(1)

TP, SEQ = 3, 12
VOCAB = CharDataset("train").vocab_size


def config(tie=True):
    return GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=3, d_model=48, d_ff=192, tie_weights=tie)


def train_cfg():
    # 3 AdamW steps with clipping: the setting tests/_tolerances measured its AdamW bounds on.
    return TrainConfig(steps=3, batch_size=4, grad_clip=1.0, eval_every=10**6, eval_batches=1, progress=False)


def _train_both_ties(tc):
    return {tie: train_tensor_parallel(config(tie), tc, sequence_parallel=True) for tie in (True, False)}


def test_tp3_sequence_parallel_seq12_trains_like_one_process():
    cfg = config()
    assert SEQ % TP == 0 and (SEQ // TP) % TP != 0  # the whole sequence splits; a shard does not
    assert all(n % TP == 0 for n in (cfg.n_head, cfg.d_model, cfg.ff_dim))
    tc = train_cfg()
    per_rank = run_on_ranks(_train_both_ties, tc, world_size=TP, timeout_s=120)
    for tie in (True, False):
        ref = train_reference(config(tie), tc)
        out = per_rank[0][tie]
        for r in range(1, TP):  # the loss is all-reduced: every rank reports it bit for bit
            assert per_rank[r][tie].train_losses == out.train_losses, (tie, r)
        # The shards sum in another order than one process and AdamW magnifies that rounding
        # near g = 0 (tests/_tolerances): losses within adamw_loss_atol(lr), the last gradients
        # in norm per tensor, the parameters bounded by what AdamW can move them and in RMS.
        assert out.train_losses == pytest.approx(ref.train_losses, abs=adamw_loss_atol(tc.lr)), tie
        model = GPT(config(tie))
        assert_grads_close_after_adamw(by_name(out.final_grads, model), by_name(flat_grads(ref.model), model),
                                       f"tie={tie}")
        assert_adamw_params_close(out.final_params, flat_params(ref.model), tc.lr, tc.steps, tc.betas,
                                  msg=f"tie={tie}")


def _positions_passed_in():
    model = apply_tensor_parallel(GPT(config(), seed=0), None, sequence_parallel=True)
    x = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    return torch.equal(model(x)[0], model(x, pos=torch.arange(SEQ))[0])


def test_tp3_sequence_parallel_takes_positions_bit_for_bit():
    # each rank embeds its shard's rows of pos (default 0..T-1): passing 0..T-1 is the same lookup
    assert run_on_ranks(_positions_passed_in, world_size=TP, timeout_s=60) == [True] * TP


def _old_local_shard_check():
    """ColumnParallelLinear as it was: its sequence-shard input checked against tp."""
    plain = ColumnParallelLinear.forward

    def forward(self, x):
        if self.sequence_parallel and x.shape[1] % self.tp:
            raise ValueError(f"sequence length {x.shape[1]} must be divisible by tp={self.tp} "
                             f"under sequence parallelism")
        return plain(self, x)

    return mock.patch.object(ColumnParallelLinear, "forward", forward)


def _train_with_old_check(tc):
    with _old_local_shard_check():
        return train_tensor_parallel(config(), tc, sequence_parallel=True)


def test_the_old_local_shard_check_rejected_this_valid_layout():
    with pytest.raises(RankError, match="sequence length 4 must be divisible by tp=3"):
        run_on_ranks(_train_with_old_check, train_cfg(), world_size=TP, timeout_s=120)
