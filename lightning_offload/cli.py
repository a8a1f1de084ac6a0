"""``OffloadCLI``: a ``LightningCLI`` with an ``--offload.*`` flag group, a shorthand for the standard way.

The standard way needs nothing from this module: ``ActivationOffloadCallback`` is a callback like any other, so a
plain ``LightningCLI`` takes it under ``trainer.callbacks`` in YAML (``configs/offload.yaml`` appends it to the
callbacks a config already lists) or from the command line::

    python train.py fit --trainer.callbacks+=lightning_offload.ActivationOffloadCallback \\
        --trainer.callbacks.init_args.mode=sync

``OffloadCLI`` adds shorter flags (``--offload.mode=sync``), always trains with exactly one offloading callback (a
later config's own ``trainer.callbacks:`` list, which replaces the list a fragment appended to, does not drop its
settings), and shows a bad value's error in one line, first.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import jsonargparse
import yaml
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
        # A bad value for the callback is said in one line, first, in our words (jsonargparse prints the whole usage
        # first); any other error is jsonargparse's as before. Parsers that should not exit are left as they are.
        parsers = [parser, *_subcommand_parsers(parser)] if parser.exit_on_error else []
        for each in parsers:
            each.exit_on_error = False
        try:
            super().parse_arguments(parser, args)
        except argparse.ArgumentError as error:
            if not parsers:
                raise
            for each in parsers:
                each.exit_on_error = True
            message = _offload_message(str(error))
            if message is None:
                parser.error(str(error), error)
            _exit_with(message, parser.prog)
        finally:
            for each in parsers:
                each.exit_on_error = True
        argv = sys.argv[1:] if args is None else args
        self._dropped_offload = _dropped_entry(argv) if isinstance(argv, (list, tuple)) else None
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
        given = getattr(self, "_given_offload", set())
        dropped = getattr(self, "_dropped_offload", None)
        if not _fold_listed_callback(config, given) and dropped is not None and config.get(GROUP) is not None:
            # A config listed the callback and a later one's ``trainer.callbacks:`` replaced the list: its settings
            # still configure the group's callback (flags given for the group win), whatever the configs' order.
            for name, value in _as_dict(dropped.get("init_args")).items():
                if name not in given:
                    config[GROUP][name] = value

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, ImportError) as error:
            message = _our_message(error)
            if message is None:
                raise
            _exit_with(message, self.parser.prog)


def _fold_listed_callback(config: Any, given: set[str]) -> bool:
    """Move an ``ActivationOffloadCallback`` listed in ``trainer.callbacks`` into the ``offload`` group; returns
    whether ``trainer.callbacks`` lists one (or several).

    ``add_lightning_class_args`` always instantiates the group's callback, and two offloading callbacks cannot both
    run (saved-tensor hooks stack; only the innermost would act), so the listed entry's arguments become the group's
    values, except those the user gave for the group (``given``), which win.
    """
    trainer = config.get("trainer")
    group = config.get(GROUP)
    if trainer is None or group is None:
        return False
    callbacks = trainer.get("callbacks")
    if callbacks is None:
        return False
    entries = callbacks if isinstance(callbacks, list) else [callbacks]
    listed = [entry for entry in entries if _is_offload_callback(entry)]
    if len(listed) != 1:
        return bool(listed)  # none, or several: the callback's setup explains why several cannot run
    entry = listed[0]
    for name, value in _as_dict(entry.get("init_args")).items():
        if name not in given:
            group[name] = value
    remaining = [other for other in entries if other is not entry]
    trainer["callbacks"] = remaining if isinstance(callbacks, list) else (remaining[0] if remaining else None)
    return True


def _dropped_entry(argv: list[str] | tuple[str, ...]) -> Any:
    """The offloading callback's entry that a config on the command line listed (``trainer.callbacks+:``, as the
    fragment does, or ``trainer.callbacks:``) and a later config's ``trainer.callbacks:`` list replaced, with no
    entry of its own after it; ``None`` where none was dropped. YAML lists do not merge, so jsonargparse keeps only
    the later list: the entry is gone from the parsed config, and only the files say it was there."""
    pending, dropped = None, None
    for trainer in _trainer_sections(argv):
        replaced = trainer.get("callbacks")
        if replaced is not None:
            ours = [entry for entry in _entries(replaced) if _is_offload_callback(entry)]
            dropped = None if ours else (pending or dropped)
            pending = ours[-1] if ours else None
        ours = [entry for entry in _entries(trainer.get("callbacks+")) if _is_offload_callback(entry)]
        if ours:
            pending, dropped = ours[-1], None
    return None if pending is not None else dropped


def _trainer_sections(argv: list[str] | tuple[str, ...]) -> Iterator[dict[str, Any]]:
    """The ``trainer`` sections of the config files given with ``--config`` (or ``-c``), in command-line order: at
    the top of a file, or under a subcommand's key (a config given before the subcommand)."""
    values: list[str] = []
    position = 0
    while position < len(argv):
        arg = str(argv[position])
        if arg in ("--config", "-c") and position + 1 < len(argv):
            values.append(str(argv[position + 1]))
            position += 1
        elif arg.startswith("--config="):
            values.append(arg.split("=", 1)[1])
        position += 1
    for value in values:
        path = Path(value)
        try:
            document = yaml.safe_load(path.read_text()) if path.is_file() else None
        except (OSError, yaml.YAMLError):
            continue  # jsonargparse says what is wrong with it
        if not isinstance(document, dict):
            continue
        for section in (document, *(v for v in document.values() if isinstance(v, dict))):
            trainer = section.get("trainer")
            if isinstance(trainer, dict):
                yield trainer


def _entries(callbacks: Any) -> list[Any]:
    if callbacks is None:
        return []
    return list(callbacks) if isinstance(callbacks, list) else [callbacks]


def _subcommand_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers of ``parser``'s subcommands (``fit``, ``validate``, ...), which raise their own errors."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            found += [sub for sub in action.choices.values() if isinstance(sub, argparse.ArgumentParser)]
    return found


# jsonargparse's message for a value its type check refused: the key (``offload.mode``, ``fit.offload.mode``) and the
# value, after "Got value:" (one type) or "Given value:" (a union of types).
_REFUSED = re.compile(r'Parser key "(?:\w+\.)*?offload\.(\w+)":.*?(?:Got|Given) value: (.*?)\s*$', re.DOTALL)


def _offload_message(message: str) -> str | None:
    """Our own message for a value of the ``--offload.*`` group that jsonargparse refused (``mode='fast'``), got by
    passing the value to the callback, which refuses it quoting the call; ``None`` for anything else."""
    refused = _REFUSED.search(message)
    if refused is None:
        return None
    name, value = refused.groups()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # only the refusal is wanted
            ActivationOffloadCallback(**{name: value})
    except (ValueError, TypeError) as error:
        return _our_message(error)
    return None


def _our_message(error: BaseException) -> str | None:
    """The message of the callback's own refusal (it quotes the call: ``ActivationOffloadCallback(mode='fast'): ...``)
    in ``error`` or the exceptions it was raised from; ``None`` where there is none."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if isinstance(current, (ValueError, TypeError, ImportError)) and text.startswith("ActivationOffloadCallback("):
            return text.splitlines()[0]
        current = current.__cause__ or current.__context__
    return None


def _exit_with(message: str, prog: str) -> NoReturn:
    """Print ``message`` as the first line, then where to read the accepted values, and exit with status 2 (as
    argparse does for a bad argument)."""
    sys.stderr.write(f"error: {message}\ntip: For details of accepted options run: {prog} --help\n")
    raise SystemExit(2)


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
