"""Exercise 04: the dynamic loss scaler's update rule and a checkpointed forward pass.
Fill in the two functions, then run the check cells of ex04_memory_techniques.ipynb.
Each check prints PASS when your code is right."""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


def update_scale(scale, good_steps, found_inf, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000):
    """One step of dynamic loss scaling. Return the new (scale, good_steps).

    * found_inf: multiply the scale by backoff_factor and reset good_steps to 0
      (the optimizer step is skipped; that is the caller's business).
    * otherwise: count one more good step; when good_steps reaches growth_interval,
      multiply the scale by growth_factor and reset good_steps to 0.
    """
    raise NotImplementedError("exercise 04: write update_scale")


def checkpointed_forward(model, idx, targets=None, every_k=1):
    """Like model(idx, targets) for a course_lib.model.GPT -> (logits, loss), but run the blocks
    model.blocks in segments of `every_k` consecutive blocks, each segment under
    torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False) so that only the segment's
    input is saved. Embeddings, ln_f, head and the loss run as in GPT.forward.

    Raise ValueError when every_k is not an int with 1 <= every_k <= model.config.n_layer.
    """
    raise NotImplementedError("exercise 04: write checkpointed_forward")
