# SPDX-License-Identifier: Apache-2.0
"""ctest's python.pytest_torch: runs test_torch.py under pytest, or exits 77
(ctest's SKIP_RETURN_CODE: the case shows as "Skipped") with the reason when
PyTorch cannot be imported."""

import os
import subprocess
import sys

here = os.path.dirname(os.path.abspath(__file__))
try:
    import torch  # noqa: F401
except ImportError as e:
    print(f"SKIPPED: PyTorch tests: could not import torch ({e}); "
          "scripts/deps.sh --torch installs python3-torch")
    sys.exit(77)
sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          os.path.join(here, "test_torch.py")], cwd=here))
