"""Exercise 04: one mixed-precision optimizer step with fp32 master weights.
Fill in the function, then run the check cells of ex04_memory_techniques.ipynb.
Each check prints PASS when your code is right."""

import torch


def master_weights_step(params, masters, optimizer, loss_scale):
    """One optimizer step of mixed-precision training with fp32 master weights.

    params      the model's 16-bit (fp16 or bf16) parameters. Their .grad hold the gradients
                of the loss multiplied by `loss_scale` (16-bit too; None where a parameter got
                no gradient).
    masters     fp32 tensors, one per parameter, same shapes and order: the master weights.
    optimizer   a torch optimizer built over `masters` (it never sees `params`).
    loss_scale  the factor the loss was multiplied by before backward (1.0 when not scaling).

    Do:
    1. give every master an fp32 gradient: its parameter's gradient in fp32, divided by
       loss_scale (None stays None);
    2. if any of those gradients holds an inf or a nan, skip the step: no optimizer step,
       masters and params keep their values;
    3. otherwise take the optimizer step on the masters, then copy each master into its
       16-bit parameter (the copy rounds it);
    4. in both cases clear the gradients: .grad = None on params and masters.

    Return True if the step was taken, False if it was skipped.
    """
    raise NotImplementedError("exercise 04: write master_weights_step")
