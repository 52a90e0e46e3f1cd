"""Without a GPU the Triton kernels run in Triton's interpreter, chosen when a kernel is
defined, i.e. when its module is first imported: so it is switched on here, before any
test module of this directory is imported. (The model code imports the kernel modules only
when their fused path first runs, so nothing collected earlier has defined them.)"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
