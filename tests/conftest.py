import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Without a GPU, Triton kernels run in Triton's CPU interpreter, which must be chosen before anything
# (torch, transformers) imports triton; backend="auto" never picks the interpreter on CPU.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
