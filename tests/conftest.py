"""Set before any test module imports torch or triton: Triton kernels in the suite run on the
CPU through Triton's interpreter (the suite is CPU-only; GPU checks are in bench/). Triton
reads this when it is first imported, which another test module's imports may do first."""

import os

os.environ["TRITON_INTERPRET"] = "1"
