"""Where the Triton kernel tests run: on CUDA, or on the CPU in Triton's interpreter
(TRITON_INTERPRET=1, with Triton installed). Importing this skips the importing test
module when neither is there."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (torch.cuda.is_available() or INTERPRET):
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
