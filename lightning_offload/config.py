"""The LightningCLI config fragment that adds the offloading callback, shipped inside the package.

``offload.yaml`` appends ``ActivationOffloadCallback`` (every option at its default) to a run's callbacks. It lives
in the package rather than in a checkout, so an installed wheel has it too::

    python -m lightning_offload.config            # print the fragment
    python -m lightning_offload.config --path     # print where it lies
    python train.py fit --config my.yaml --config "$(python -m lightning_offload.config --path)"
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

FRAGMENT_NAME = "offload.yaml"


def fragment_path() -> Path:
    """The installed fragment's path on disk.

    Returns:
        The path of ``offload.yaml`` inside the installed ``lightning_offload`` package.

    Raises:
        FileNotFoundError: The package is imported from somewhere without a file system path (a zip archive), or
            the fragment is missing from the installation.
    """
    resource = resources.files("lightning_offload") / FRAGMENT_NAME
    # LightningCLI's --config needs a real file; a package imported from a zip archive has none to point at.
    if not isinstance(resource, Path):
        raise FileNotFoundError(
            f"lightning_offload is imported from {resource!s}, which is not on the file system: "
            "write the fragment out with `python -m lightning_offload.config > offload.yaml` instead"
        )
    if not resource.is_file():
        raise FileNotFoundError(f"{resource} is missing: the installation of lightning_offload is incomplete")
    return resource


def fragment_text() -> str:
    """The fragment's YAML text.

    Returns:
        The contents of ``offload.yaml``, read through the package's resources (works from a zip archive too).
    """
    return (resources.files("lightning_offload") / FRAGMENT_NAME).read_text(encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    """Print the fragment, or with ``--path`` where it lies.

    Args:
        argv: The command line arguments after the program name; ``None`` reads ``sys.argv``.

    Returns:
        The exit status: 0 when printed, 1 when the fragment cannot be found.
    """
    parser = argparse.ArgumentParser(
        prog="python -m lightning_offload.config",
        description=(
            "Print the LightningCLI config fragment that adds ActivationOffloadCallback (every option at its "
            "default) to a run's callbacks. Give it after your own config: "
            'python train.py fit --config my.yaml --config "$(python -m lightning_offload.config --path)"'
        ),
    )
    parser.add_argument("--path", action="store_true", help="print the fragment's path instead of its contents")
    args = parser.parse_args(argv)
    try:
        if args.path:
            print(fragment_path())
        else:
            sys.stdout.write(fragment_text())
    except FileNotFoundError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
