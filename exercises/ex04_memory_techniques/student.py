"""Exercise 04: one mixed-precision optimizer step with fp32 master weights and gradient
clipping. Write the function, then run the check cells of ex04_memory_techniques.ipynb.
Each check prints PASS when your code is right."""

import torch


def master_weights_step(params, masters, optimizer, loss_scale, max_norm=None):
    """One optimizer step of mixed-precision training with fp32 master weights.

    params      the model's 16-bit (fp16 or bf16) parameters. Their .grad hold the gradients
                of the loss multiplied by `loss_scale` (16-bit too; None where a parameter got
                no gradient).
    masters     fp32 tensors, one per parameter, same shapes and order: the master weights.
    optimizer   a torch optimizer built over `masters` (it never sees `params`).
    loss_scale  the factor the loss was multiplied by before backward (1.0 when not scaling).
    max_norm    None, or the largest global gradient norm allowed, in the units of the true
                (unscaled) gradient: the step must equal what an fp32 model would do with
                torch.nn.utils.clip_grad_norm_(its parameters, max_norm) before its step.

    Afterwards:
    * if every gradient is finite: the masters have taken one optimizer step on the true
      gradient of the loss (clipped as above when max_norm is given), and each parameter holds
      its master rounded to the parameter's dtype;
    * otherwise (an inf or a nan anywhere: the loss scale was too large): masters, parameters
      and the optimizer's state are exactly as before;
    * in both cases every .grad of params and masters is None.

    Return True if the step was taken, False if it was skipped.
    """
    raise NotImplementedError("exercise 04: write master_weights_step")
