"""Benchmarks: side-by-side, alternating, warm-up discarded, medians. Not tests.

Importing this package is cheap (no torch): the suite runner and the report writer use it.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the source checkout
# Peer libraries (FairScale, Betty, TorchOpt) are benchmark anchors only: `make bench`
# installs them here, beside the package environment and never into it.
PEERS = ROOT / ".bench"
