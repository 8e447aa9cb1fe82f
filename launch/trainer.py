"""``from launch.trainer import train``: the loop lives in :mod:`launch.loop.trainer`."""

from launch.loop.trainer import Hooks, Trainer, train

__all__ = ["Hooks", "Trainer", "train"]
