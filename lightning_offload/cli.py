"""``OffloadCLI``: a ``LightningCLI`` with an ``--offload.*`` flag group, a shorthand for the standard way.

The standard way needs nothing from this module: ``ActivationOffloadCallback`` is a callback like any other, so a
plain ``LightningCLI`` takes it under ``trainer.callbacks`` in YAML (``configs/offload.yaml`` appends it to the
callbacks a config already lists) or from the command line::

    python train.py fit --trainer.callbacks+=lightning_offload.ActivationOffloadCallback \\
        --trainer.callbacks.init_args.mode=sync

``OffloadCLI`` only adds shorter flags (``--offload.mode=sync``) and always trains with exactly one offloading
callback.
"""

from __future__ import annotations

import importlib
from typing import Any

import jsonargparse
from jsonargparse import Namespace
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from typing_extensions import override

from lightning_offload.callback import ActivationOffloadCallback

__all__ = ["OffloadCLI"]

GROUP = "offload"

# jsonargparse's private keyword for parsing without validating: ``_skip_check`` until 4.35, ``_skip_validation`` since.
_JSONARGPARSE = tuple(int(part) for part in jsonargparse.__version__.split(".")[:2])
_SKIP_VALIDATION = {"_skip_validation" if _JSONARGPARSE >= (4, 35) else "_skip_check": True}


class OffloadCLI(LightningCLI):
    """``LightningCLI`` that always trains with one :class:`~lightning_offload.ActivationOffloadCallback`.

    Its options form the ``--offload.*`` group (``--offload.mode=sync``, ``--offload.memory_picture=true``, ...; see
    ``--help``), next to ``--trainer.*``, ``--model.*`` and ``--data.*``, for any LightningModule; a config file may
    set them under ``offload:``. When a config also lists the callback under ``trainer.callbacks`` (as
    ``configs/offload.yaml`` does), that entry configures the callback, every ``--offload.*`` value you give (on the
    command line or under ``offload:``) applies on top of it, and the entry gives way to the group's callback: there
    is still exactly one. Every other listed callback stays.

    Example::

        # train.py
        from lightning_offload.cli import OffloadCLI

        if __name__ == "__main__":
            OffloadCLI(MyModel, MyDataModule)

        # python train.py fit --config my.yaml --config configs/offload.yaml --offload.mode=streamed

    Takes the arguments of ``LightningCLI``.
    """

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ActivationOffloadCallback, GROUP)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        super().parse_arguments(parser, args)
        # Parsed again without defaults: what the user gave, so that a given value wins over a listed callback's
        # even when it equals the default (``--offload.mode=streamed`` over a YAML ``mode: sync``). Not validated:
        # the full parse above did that, and without defaults a required argument that only a default config file
        # gives (``parser_kwargs={"default_config_files": ...}``) would read as missing.
        if isinstance(args, (dict, Namespace)):
            given = parser.parse_object(args, defaults=False, **_SKIP_VALIDATION)
        else:
            given = parser.parse_args(args, defaults=False, **_SKIP_VALIDATION)
        subcommand = self.config.get("subcommand")
        scope = given.get(subcommand) if subcommand else given
        group = scope.get(GROUP) if scope is not None else None
        self._given_offload = set(_as_dict(group))

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand is not None else self.config
        _fold_listed_callback(config, getattr(self, "_given_offload", set()))


def _fold_listed_callback(config: Any, given: set[str]) -> None:
    """Move an ``ActivationOffloadCallback`` listed in ``trainer.callbacks`` into the ``offload`` group.

    ``add_lightning_class_args`` always instantiates the group's callback, and two offloading callbacks cannot both
    run (saved-tensor hooks stack; only the innermost would act), so the listed entry's arguments become the group's
    values, except those the user gave for the group (``given``), which win.
    """
    trainer = config.get("trainer")
    group = config.get(GROUP)
    if trainer is None or group is None:
        return
    callbacks = trainer.get("callbacks")
    if callbacks is None:
        return
    entries = callbacks if isinstance(callbacks, list) else [callbacks]
    listed = [entry for entry in entries if _is_offload_callback(entry)]
    if len(listed) != 1:
        return  # none, or several: the callback's setup explains why several cannot run
    entry = listed[0]
    for name, value in _as_dict(entry.get("init_args")).items():
        if name not in given:
            group[name] = value
    remaining = [other for other in entries if other is not entry]
    trainer["callbacks"] = remaining if isinstance(callbacks, list) else (remaining[0] if remaining else None)


def _is_offload_callback(entry: Any) -> bool:
    class_path = entry.get("class_path") if hasattr(entry, "get") else None
    if not isinstance(class_path, str) or "." not in class_path:
        return False
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError):
        return False
    # Only the class itself: a subclass may take other arguments, so it keeps its own entry.
    return cls is ActivationOffloadCallback


def _as_dict(namespace: Any) -> dict[str, Any]:
    if namespace is None:
        return {}
    if isinstance(namespace, dict):
        return dict(namespace)
    return dict(vars(namespace))
