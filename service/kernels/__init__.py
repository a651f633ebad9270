"""Compiled kernels for the hot path, chosen at run time for this CPU (``native``); the eager torch paths otherwise.

``KERNEL_DTYPES``: the model dtypes the float kernels (the step ops, the batched LoRA math) take.
"""

import torch

__all__ = ["KERNEL_DTYPES"]

KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # src/*.cpp's dtype codes 0 and 1
