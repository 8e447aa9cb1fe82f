"""The model's stack of layers, as loco reads it for any model: what Streaming DiLoCo cuts its fragments by and
what ``run.shard: fsdp`` makes its units of, so that a fragment is made of whole units."""

from __future__ import annotations

from typing import Optional

import torch.nn as nn


def layer_stack(model: nn.Module) -> Optional[nn.Module]:
    """The list of modules (``ModuleList`` or ``Sequential``) holding the most parameters: loco's ``layers``, a
    ``transformers`` model's ``layers`` or ``h``, wherever it is nested; None where the model has none."""
    lists = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


class HeadedModel(nn.Module):
    """A model that names the layer making its logits (loco's own models do: ``launch.models.base.RunModel``)."""

    def output_head(self) -> Optional[nn.Module]:
        """The layer that makes the logits, where it is not the embedding (tied); Muon and FSDP leave it out."""
        return None


def output_head(model: nn.Module) -> Optional[nn.Module]:
    """The logits' layer of ``model`` where it names one (None: tied, or a model that names none)."""
    return model.output_head() if isinstance(model, HeadedModel) else None
