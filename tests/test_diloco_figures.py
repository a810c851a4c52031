"""Notebook 13's widget (course_lib.estimate.diloco_figures): its numbers against hand-computed
ones, its first state equal to the static figure, and bad settings refused."""

import pytest

from course_lib.estimate import diloco_figures as D
from course_lib.estimate.params import LLAMA3_8B, param_count

P = param_count(LLAMA3_8B)  # 8,030,261,248


def test_sync_is_a_ring_all_reduce_of_the_whole_model():
    # 2 (R-1)/R * P * 4 bytes at 10 Gb/s = 1.25e9 bytes/s; float64 rounding only (~1e-16 relative)
    want = 2 * 3 / 4 * P * 4 / 1.25e9
    assert D.sync_seconds(P, 4, 10) == pytest.approx(want, rel=1e-12)
    assert D.sync_seconds(P, 4, 10, wire_bytes=2) == pytest.approx(want / 2, rel=1e-12)


def test_share_and_bytes_per_step():
    t = D.sync_seconds(P, 4, 10)
    assert D.round_share(P, 4, 100, 10, 1.0) == pytest.approx(t / (100 + t), rel=1e-12)  # float64 rounding
    assert D.bytes_per_step(P, 100) == P * 4 / 100
    shares = [D.round_share(P, 4, h, 10, 1.0) for h in D.H_STOPS]
    assert shares == sorted(shares, reverse=True)  # meeting less often never costs more of the time
    assert D.round_share(P, 4, 1, 10, 1.0) > 0.9  # DDP over a 10 Gb/s link: communication dominates


def test_caption_states_the_numbers():
    v = D.diloco_view()
    assert v.valid and v.size == (750, 360)
    assert "29.9 GiB per sync" in v.caption and "38.5 s" in v.caption and "27.8%" in v.caption


def test_first_state_is_the_static_figure():
    args = ("Llama-3 70B", 8, 50, 100, 2.0)
    assert D.diloco_widget(*args).first_view == D.diloco_view(*args)


@pytest.mark.parametrize("kwargs, message", [
    (dict(replicas=3), "replicas=3 must be one of"),
    (dict(inner_steps=7), "inner_steps=7 must be one of"),
    (dict(model="GPT-5"), "model='GPT-5' must be one of"),
])
def test_bad_settings(kwargs, message):
    assert not D.diloco_view(**kwargs).valid and message in D.diloco_view(**kwargs).caption
    with pytest.raises(ValueError, match=message):
        D.diloco_widget(**kwargs)
