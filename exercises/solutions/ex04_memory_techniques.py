"""Reference solution for exercise 04 (kept apart from the learner's stubs)."""

import torch


def master_weights_step(params, masters, optimizer, loss_scale, max_norm=None):
    """One mixed-precision step with fp32 master weights, the unscaled gradient clipped to a
    global norm of max_norm; True if taken, False if skipped."""
    grads = []
    for p, m in zip(params, masters):
        # Unscale in fp32: the 16-bit gradient is exact in fp32, and 1 / loss_scale is a power of
        # two, so the multiplication is exact too (in 16 bits small gradients would underflow).
        m.grad = None if p.grad is None else p.grad.to(torch.float32) * (1.0 / loss_scale)
        grads.append(m.grad)
    overflow = any(g is not None and not torch.isfinite(g).all() for g in grads)
    if not overflow:
        if max_norm is not None:  # after unscaling: max_norm is in the true gradient's units
            torch.nn.utils.clip_grad_norm_(masters, max_norm)  # fp32: the squares cannot overflow
        optimizer.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)  # round the fp32 master to the parameter's 16 bits
    for p, m in zip(params, masters):
        p.grad = m.grad = None
    return not overflow
