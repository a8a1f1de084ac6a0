"""``OffloadCLI``: a ``LightningCLI`` with an ``--offload.*`` flag group for activation offloading, on any model."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from lightning_offload.callback import ActivationOffloadCallback

__all__ = ["OffloadCLI"]

GROUP = "offload"


class OffloadCLI(LightningCLI):
    """``LightningCLI`` that always trains with one :class:`~lightning_offload.ActivationOffloadCallback`.

    Its options form the ``--offload.*`` group (``--offload.mode=sync``, ``--offload.memory_picture=true``, ...; see
    ``--help``), next to ``--trainer.*``, ``--model.*`` and ``--data.*``, for any LightningModule. A config file may
    set them under ``offload:`` or list the callback under ``trainer.callbacks`` (as ``configs/offload.yaml``
    does); in the second case that entry configures the callback and the ``--offload.*`` values that differ from
    the defaults are applied on top of it, so there is still exactly one callback.

    Example::

        # train.py
        from lightning_offload.cli import OffloadCLI

        if __name__ == "__main__":
            OffloadCLI(MyModel, MyDataModule)

        # python train.py fit --offload.mode=streamed --offload.max_offload_bytes=4294967296

    Takes the arguments of ``LightningCLI``.
    """

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(ActivationOffloadCallback, GROUP)

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand is not None else self.config
        _fold_listed_callback(config)


def _fold_listed_callback(config: Any) -> None:
    """Move an ``ActivationOffloadCallback`` listed in ``trainer.callbacks`` into the ``offload`` group.

    ``add_lightning_class_args`` always instantiates the group's callback, and two offloading callbacks cannot both
    run (saved-tensor hooks stack; only the innermost would act), so the listed one becomes the group's settings,
    with the group's non-default values on top.
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
    explicit = {name: value for name, value in _as_dict(group).items() if value != _DEFAULTS.get(name, value)}
    merged = {**_as_dict(entry.get("init_args")), **explicit}
    for name, value in merged.items():
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


_DEFAULTS: dict[str, Any] = {
    name: parameter.default
    for name, parameter in inspect.signature(ActivationOffloadCallback.__init__).parameters.items()
    if parameter.default is not inspect.Parameter.empty
}
