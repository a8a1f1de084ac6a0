"""Train the demo transformer from the command line: a plain ``LightningCLI``, the callback configured like any other.

Examples::

    python examples/cli.py fit --config configs/demo_cpu.yaml               # a few steps on the CPU
    python examples/cli.py fit --config my.yaml --config "$(python -m lightning_offload.config --path)"  # + offloading
    python examples/cli.py fit --trainer.callbacks+=lightning_offload.ActivationOffloadCallback \\
        --trainer.callbacks.init_args.mode=sync --trainer.max_steps=20     # flags, no config file
    python examples/cli.py fit --trainer.callbacks.help lightning_offload.ActivationOffloadCallback   # its options

Nothing here is specific to offloading: any ``LightningCLI`` takes the callback the same way. (For shorter
``--offload.*`` flags, ``lightning_offload.cli.OffloadCLI`` is a drop-in replacement for ``LightningCLI``.)
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

# The demo model sits next to this script; make it importable however the script is started.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_model import DemoTransformer, SyntheticTokens


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI (``args=None``: read ``sys.argv``)."""
    return LightningCLI(DemoTransformer, SyntheticTokens, trainer_defaults={"max_epochs": 1}, args=args)


if __name__ == "__main__":
    main()
