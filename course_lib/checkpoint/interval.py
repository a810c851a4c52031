"""Failures at scale, and how often to checkpoint (pure formulas, no processes).

If each GPU (with its host, links, ...) fails independently with mean time between failures
M_1, a job on n of them stops at the first failure of any: its MTBF is M_1 / n. Llama 3 405B
(Dubey et al., "The Llama 3 Herd of Models", 2024, arXiv:2407.21783, section 3.3.4) trained on
up to 16,384 H100s and saw 466 job interruptions in a 54-day snapshot (47 planned, 419
unexpected): one every 54 * 24 / 466 = 2.78 hours, an unexpected one every 54 * 24 / 419 =
3.09 hours. The checkpoint interval answers the unexpected ones (a planned stop can save first),
so notebook 12 prices it with the 3.09 h: llama3_job_mtbf_hours(unexpected_only=True), equal to
job_mtbf_hours(llama3_per_gpu_mtbf_hours(), LLAMA3_GPUS).

Checkpointing every tau seconds with a save that costs delta seconds of stalled training, a
failure loses on average half an interval of work plus the restart; per unit of time the
fraction wasted is about

    waste(tau) = delta / tau  +  tau / (2 M)          (saving)  +  (recomputing lost work)

minimised at Young's interval (Young 1974; Daly 2006 refines it for large delta / M):

    tau* = sqrt(2 * delta * M),     waste(tau*) = sqrt(2 * delta / M)

An async save shrinks the delta that training stalls for (async_save.py), which moves tau*
down and the waste with it.
"""

from __future__ import annotations

import math

LLAMA3_INTERRUPTIONS = 466  # Dubey et al. 2024, section 3.3.4: 54-day snapshot of Llama 3 405B pre-training
LLAMA3_UNEXPECTED = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384


def job_mtbf_hours(per_gpu_mtbf_hours: float, n_gpus: int) -> float:
    """MTBF of a job that stops when any of n_gpus independent GPUs fails: M_1 / n."""
    if not per_gpu_mtbf_hours > 0 or n_gpus < 1:
        raise ValueError(f"per_gpu_mtbf_hours={per_gpu_mtbf_hours} must be > 0 and n_gpus={n_gpus} >= 1")
    return per_gpu_mtbf_hours / n_gpus


def llama3_job_mtbf_hours(unexpected_only: bool = False) -> float:
    """Hours between interruptions in the Llama 3 snapshot: 54 days * 24 / 466 (or / 419)."""
    return LLAMA3_DAYS * 24 / (LLAMA3_UNEXPECTED if unexpected_only else LLAMA3_INTERRUPTIONS)


def llama3_per_gpu_mtbf_hours() -> float:
    """The per-GPU MTBF implied by the unexpected interruptions: 16384 * 54 * 24 / 419 hours."""
    return LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_UNEXPECTED


def young_daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """tau* = sqrt(2 * delta * M): the checkpoint interval with the least expected waste."""
    if not save_seconds > 0 or not mtbf_seconds > 0:
        raise ValueError(f"save_seconds={save_seconds} and mtbf_seconds={mtbf_seconds} must be > 0")
    return math.sqrt(2 * save_seconds * mtbf_seconds)


def wasted_fraction(interval_seconds: float, save_seconds: float, mtbf_seconds: float) -> float:
    """delta / tau + tau / (2 M): time spent saving plus expected recomputation, per unit time."""
    if not interval_seconds > 0:
        raise ValueError(f"interval_seconds={interval_seconds} must be > 0")
    return save_seconds / interval_seconds + interval_seconds / (2 * mtbf_seconds)
