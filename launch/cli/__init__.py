"""The ``loco`` command and its subcommands; ``python -m launch.cli`` runs it (torchrun's ``-m launch.cli``)."""

from launch.cli.commands import main

__all__ = ["main"]
