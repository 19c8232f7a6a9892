"""Imported first by a test module whose Triton kernels must run without a CUDA device: then it
turns on Triton's CPU interpreter (TRITON_INTERPRET=1), which works only when set before triton
itself is imported, and says so if triton came first. With a CUDA device it does nothing."""

import os
import sys

import torch

if not torch.cuda.is_available():
    assert "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1", (
        "triton was imported before TRITON_INTERPRET=1 could be set; its CPU interpreter is off")
    os.environ["TRITON_INTERPRET"] = "1"
