"""Optional parts of loco and the pip extra that brings each.

``pip install loco`` holds what ``loco train`` and ``loco simulate`` need. The rest
comes with an extra:

============  ==========================  ===============================================
extra         package                     needed for
============  ==========================  ===============================================
``swarm``     hivemind                    ``loco join``, ``loco status``, ``transport.backend: hivemind``
``wandb``     wandb                       ``log.wandb: true``
``hf``        datasets, transformers,     ``data.source: hf``, ``model.hf_config``,
              safetensors                 ``model.init_from``
``dev``       all of the above, pytest,   the test suite (Triton's interpreter runs the kernels
              triton                      on CPU); CUDA builds of torch bring Triton themselves
============  ==========================  ===============================================

:func:`require` imports the package or raises :class:`MissingExtra`, a one-line
error that names the feature and the ``pip install`` that adds it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRA_OF = {"hivemind": "swarm", "wandb": "wandb", "datasets": "hf", "transformers": "hf", "safetensors": "hf",
            "triton": "dev"}


class MissingExtra(ImportError):
    """An optional package that a feature needs is not installed (or does not import)."""


def require(module: str, feature: str) -> ModuleType:
    """``import module``, or a :class:`MissingExtra` naming ``feature`` and the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        extra = EXTRA_OF.get(module.split(".")[0], "dev")
        broken = "" if getattr(e, "name", None) == module.split(".")[0] else f" (importing it failed: {e})"
        raise MissingExtra(f"{feature} needs the {module.split('.')[0]} package{broken}: "
                           f"pip install \"loco[{extra}]\"") from None
