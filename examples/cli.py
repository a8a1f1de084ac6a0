"""Train the demo transformer from the command line, with activation offloading configured by ``--offload.*``.

Examples::

    python examples/cli.py fit --config configs/demo_cpu.yaml               # a few steps on the CPU
    python examples/cli.py fit --config configs/offload.yaml                # on a GPU, the callback from YAML
    python examples/cli.py fit --offload.mode=sync --trainer.max_steps=20   # flags, no config file
    python examples/cli.py fit --help                                       # every option, --offload.* included

``OffloadCLI`` works with any LightningModule / LightningDataModule: pass your classes instead of the demo's.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The demo model sits next to this script; make it importable however the script is started.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_model import DemoTransformer, SyntheticTokens

from lightning_offload.cli import OffloadCLI


def main(args: list[str] | None = None) -> OffloadCLI:
    """Run the CLI (``args=None``: read ``sys.argv``)."""
    return OffloadCLI(DemoTransformer, SyntheticTokens, trainer_defaults={"max_epochs": 1}, args=args)


if __name__ == "__main__":
    main()
