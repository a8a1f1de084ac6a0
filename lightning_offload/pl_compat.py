"""``ActivationOffloadCallback`` for code that imports ``pytorch_lightning`` instead of ``lightning.pytorch``.

``lightning.pytorch`` and ``pytorch_lightning`` ship the same trainer as two separate class hierarchies, and each
``Trainer`` accepts only callbacks derived from its own ``Callback``. This twin derives from both; everything else
is the shared implementation in :mod:`lightning_offload.callback`.

Example::

    import pytorch_lightning as pl
    from lightning_offload.pl_compat import ActivationOffloadCallback

    trainer = pl.Trainer(callbacks=[ActivationOffloadCallback()])
"""

from __future__ import annotations

try:
    import pytorch_lightning
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ModuleNotFoundError(
        "`from lightning_offload.pl_compat import ActivationOffloadCallback` needs the `pytorch_lightning` package "
        "(pip install pytorch-lightning). With `import lightning.pytorch`, use "
        "`from lightning_offload import ActivationOffloadCallback` instead."
    ) from err

from lightning_offload.callback import ActivationOffloadCallback as _ActivationOffloadCallback

__all__ = ["ActivationOffloadCallback"]


class ActivationOffloadCallback(_ActivationOffloadCallback, pytorch_lightning.Callback):
    """:class:`lightning_offload.ActivationOffloadCallback` for a ``pytorch_lightning.Trainer``.

    Same arguments, hooks and logged metrics; see :class:`lightning_offload.ActivationOffloadCallback`.
    """
