"""Stopping by signal: Ctrl-C (SIGINT) or SIGTERM asks the training loop to stop where it can save.

Inside :func:`stop_signals` (the CLI's ``train``, ``simulate`` and ``join``) a first signal is a request: the loop
stops at the next point where every process can save (the end of the current step for one worker; the next
point every worker reaches, a sync or any step for DDP, in the simulator and under torchrun), saves a
checkpoint there and raises :class:`Interrupted`. A second signal stops at once, without saving. Outside a
training loop (loading data, the final evaluation) the first signal stops at once too.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

from launch.store.checkpoint import CheckpointError, save_checkpoint


class Interrupted(KeyboardInterrupt):
    """The run stopped on a signal (``signum``: SIGINT for Ctrl-C, or SIGTERM).

    ``saved`` is the checkpoint written before stopping (None when the signal could not wait for one: a second
    signal, or one outside the training loop). The CLI exits with 128 + signum: 130 for Ctrl-C, 143 for SIGTERM.
    """

    def __init__(self, signum: int = signal.SIGINT, saved: Optional[Path] = None, clean: bool = False) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum, self.saved = int(signum), saved
        self.clean = clean  # raised where every worker stopped together, after the save (not mid-step)


class StopRequest:
    """A signal waiting for the training loops of this process to reach a point where they can save."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.listening = 0  # training loops (simulated workers included) that check ``signum`` at step ends
        self.writing = 0  # checkpoint writes under way: a first signal waits for them to complete
        self.cut: Optional[int] = None  # a second signal that cut a write short (torch reports it as a failed write)

    @contextmanager
    def saving(self) -> Iterator[None]:
        """A checkpoint write that a first signal does not cut short (it is recorded in ``signum``); a second
        signal still stops at once, and the atomic write leaves the older checkpoints as they were."""
        self.writing += 1
        try:
            yield
        finally:
            self.writing -= 1

    @contextmanager
    def listened(self, listening: bool = True) -> Iterator[None]:
        """A training loop that checks ``signum`` at its step ends (``listening``): while one runs, a first signal
        waits for it instead of stopping the process at once."""
        if listening:
            self.listening += 1
        try:
            yield
        finally:
            if listening:
                self.listening -= 1


STOP = StopRequest()


@contextmanager
def stop_signals() -> Iterator[None]:
    """Turn SIGINT and SIGTERM into a request to stop at the next point where the run can save a checkpoint.

    Outside a training loop (loading data, the final evaluation) or on a second signal, :class:`Interrupted`
    is raised at once. Only the main thread can install handlers; elsewhere this does nothing.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if STOP.writing and STOP.signum is None:
            STOP.signum = signum
            print(f"loco: {signal.Signals(signum).name}: stopping once the checkpoint being written is complete "
                  "(a second signal stops at once)", file=sys.stderr, flush=True)
            return
        if STOP.signum is not None or STOP.listening == 0:
            if STOP.writing:
                STOP.cut = signum
            raise Interrupted(signum)
        STOP.signum = signum
        print(f"loco: {signal.Signals(signum).name}: stopping at the next point where the run can save a checkpoint "
              "(a second signal stops at once, without saving)", file=sys.stderr, flush=True)

    # a signal the process was started to ignore (nohup, a shell's background job) stays ignored
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)
                if signal.getsignal(s) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        STOP.signum = STOP.cut = None


def save_waiting_for_it(directory: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """``save_checkpoint`` that a first SIGINT/SIGTERM does not interrupt (see :meth:`StopRequest.saving`).

    A second signal stops at once; torch's writer turns its exception into a failed write, which is reported
    as the Interrupted it was, not as a full disk. The older checkpoints stay as they were either way.
    """
    try:
        with STOP.saving():
            return save_checkpoint(directory, step, state, keep=keep)
    except (CheckpointError, RuntimeError):
        if STOP.cut is not None:
            raise Interrupted(STOP.cut) from None
        raise
