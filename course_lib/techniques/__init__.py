"""Single-device techniques that every strategy can combine with (notebook 04).

    amp.py                       dynamic loss scaling, fp32 master weights
    activation_checkpointing.py  recompute blocks in backward instead of saving their activations
    accumulation.py              k micro-batches, one optimizer step
    muon.py                      Muon (Newton-Schulz), muon_split / MuonAdamW (notebook 08; sharded: parallel/zero/muon.py)
    fp8.py                       FP8 formats, scaled casts (tensor/row/tile/block/MX), FP8Linear, apply_fp8
                                 (fp8_figures.py: the notebook's pictures of them; fp8_hardware.py: torch._scaled_mm
                                 on GPUs of compute capability >= 8.9, the emulation elsewhere; fp4.py: MXFP4 and
                                 NVFP4, the e2m1 grid and its block scales)
    compiled.py                  torch.compile per block (apply_compile) under torch's DDP and FSDP2, one step
                                 against eager (notebook 03)
"""
