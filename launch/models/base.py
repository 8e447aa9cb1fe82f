"""What the loop asks of a model loco builds (its own decoder, or a ``transformers`` causal LM), declared once.

A module handed in through the Python API (``Trainer(cfg, model=...)``) need not be one: the loop then takes
the defaults (no named sizes to save, no Hugging Face config, the head found as the embedding's).
"""

from __future__ import annotations

from typing import Any, Optional

import torch.nn as nn

from diloco.layers import HeadedModel


class RunModel(HeadedModel):
    """A model of loco's: token ids [B, T] -> logits [B, T, V]."""

    #: the named sizes it was built from, saved in checkpoints (``model_args``); None where the model has none
    args: Any = None

    def config_dict(self) -> Optional[dict[str, Any]]:
        """The Hugging Face config it was built from (saved in checkpoints as ``hf_config``); None for loco's own."""
        return None


def model_args(model: nn.Module) -> Any:
    """The named sizes of ``model`` (None for a module that is not loco's)."""
    return model.args if isinstance(model, RunModel) else None

