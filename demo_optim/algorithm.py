"""DeMo in loco's training loop: the optimizer does the exchange, so no gradient all-reduce runs."""

from __future__ import annotations

from typing import Any, Optional

import torch

from diloco.algorithm import Algorithm, ConfigConflict, register
from diloco.comm.base import Transport
from demo_optim.optimizer import DeMo
from demo_optim.payload import Layout
from diloco.compress import plan_for


@register
class DeMoAlgorithm(Algorithm):
    """``algo.name=demo``. Every worker calls ``DeMo.step()`` every step (it holds the collective), even
    with non-finite gradients: such a worker sends nothing and still applies the others' update."""

    name = "demo"
    replicated_state = False  # the parameters agree; each worker's momentum (delta) is its own
    # whether a step tests its gradients on the device, with no host read (None: on accelerators, where a read waits
    # for the device; on a CPU it costs nothing, and the guarded step's copies would)
    checks_on_device: Optional[bool] = None

    def __init__(self, model: torch.nn.Module, optimizer: DeMo, transport: Optional[Transport] = None,
                 grad_clip: float = 0.0, *, inner: Optional[Transport] = None) -> None:
        if not isinstance(optimizer, DeMo):
            raise TypeError("algo.name=demo needs a demo_optim.DeMo optimizer")
        super().__init__(model, optimizer, transport or optimizer.transport, grad_clip, inner=inner)

    @classmethod
    def make_optimizer(cls, cfg: Any, groups: list[dict[str, Any]], device: torch.device,
                       transport: Optional[Transport]) -> DeMo:
        """DeMo is the optimizer: it runs the exchange inside its step."""
        a = cfg.algo
        return DeMo(groups, lr=cfg.optim.lr, compression_decay=a.compression_decay,
                    compression_topk=a.compression_topk, compression_chunk=a.compression_chunk,
                    transport=transport, chunk_rule=a.chunk_rule, sign_values=a.sign_values, nonfinite=a.nonfinite)

    @classmethod
    def payload_label(cls, algo: dict[str, Any], codec: Optional[str]) -> list[str]:
        """Nothing: it sends its own DCT top-k payload, which its algo.compression_* settings shape."""
        return []

    @classmethod
    def optimizer_copies(cls, cfg: Any) -> Optional[float]:
        """Its momentum (kept in the parameters' shape or as DCT coefficients: about as many values)."""
        return 1.0

    @classmethod
    def state_copies(cls, cfg: Any) -> float:
        return 0.0

    @classmethod
    def step_payload_bytes(cls, shapes: list[tuple[int, ...]], algo: dict[str, Any]) -> Optional[int]:
        """Its wire payload: every parameter's k coefficients per DCT block, their indices and the header."""
        plans = [plan_for(shape, algo.get("compression_chunk", 64), algo.get("compression_topk", 32),
                          algo.get("chunk_rule", "auto")) for shape in shapes]
        return Layout(plans, bool(algo.get("sign_values", False)), None).wire_size()

    @classmethod
    def check_config(cls, cfg: Any, n_layers: int) -> None:
        super().check_config(cfg, n_layers)
        if cfg.optim.name == "muon":
            raise ConfigConflict("optim.name", "DeMo is its own inner optimizer (signed steps on the exchanged DCT "
                                               "components): muon cannot run under it; leave optim.name at adamw")
        if cfg.run.shard != "none":
            raise ConfigConflict("run.shard", "DeMo takes its DCT chunks of whole tensors, which run.shard=fsdp cuts "
                                              "among the node's processes: DeMo runs unsharded (run.shard=none)")
        if cfg.compress.codec != "fp32":
            raise ConfigConflict("compress.codec", "DeMo sends its own DCT top-k payload (tune algo.compression_topk "
                                                   "/ algo.sign_values); leave compress.codec at fp32")

    def _checks_on_device(self) -> bool:
        """DeMo with ``nonfinite="skip"`` decides on the device: the optimizer gets ``found_inf``, leaves its
        parameters and momenta as they were where it is set, and says so in its payload's flag byte (see
        ``DeMo.step``). The step's one host read is then the accept decision of the payloads it received."""
        if self.optimizer.nonfinite != "skip":
            return False
        if self.checks_on_device is not None:
            return self.checks_on_device
        return self.optimizer._device().type != "cpu"

    def _update(self) -> None:
        self.optimizer.grads_checked = True  # the step just checked the gradient norm
        with self.transport.exchange_scope(barrier=False):  # one all-gather a step: its bytes are the peak's
            self.optimizer.step()

    def _skipped_update(self) -> None:
        self.optimizer.contribute = False  # send nothing, still apply the others' update
        self._update()

    def _after_step(self) -> dict[str, Any]:
        return {"contributors": self.optimizer.last_contributors}

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.update(skipped_payloads=self.optimizer.rejected_payloads)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.optimizer.rejected_payloads = int(state.get("skipped_payloads", 0))
