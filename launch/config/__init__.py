"""Typed run configuration: the API the application uses.

A config is built in layers: code defaults, then each ``--config FILE`` in order
(files hold only differences from the defaults), then each ``--set a.b=value``.
Every value remembers where it came from, so an error names the file (or the
``--set`` flag), the key, and what is allowed. Nothing is trained before the
whole config has been checked.

Its parts: :mod:`launch.config.schema` (the sections and their documented fields), :mod:`launch.config.loader`
(YAML files, presets, ``--set`` overrides) and :mod:`launch.config.validation` (checks across fields). Here: loading
and dumping a config, and what runs must agree on.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import yaml

from diloco.comm.agreement import flat_settings
from launch.config.loader import ConfigBuilder, resolve_config_path
from launch.config.schema import Config, ConfigError
from launch.config.validation import validate


def load_config(files: list[str] | tuple[str, ...] = (), overrides: list[str] | tuple[str, ...] = (),
                extra: dict[str, Any] | None = None) -> tuple[Config, ConfigBuilder]:
    """Defaults <- each file <- each ``--set`` <- ``extra`` ({'run.seed': (3, '--seed')} from flags); then validate."""
    builder = ConfigBuilder()
    for f in map(resolve_config_path, files):
        builder.apply_file(f)
    for o in overrides:
        builder.apply_override(o)
    for key, (value, source) in (extra or {}).items():
        builder.set(key, value, source)
    sim = builder.config.sim
    if sim.step_time_note and builder.where("sim.step_time") != builder.where("sim.step_time_note"):
        sim.step_time_note = None  # it names the step time set beside it, not one given elsewhere
    validate(builder.config, builder.where)
    for note in builder.retired_notes() + builder.unread_notes():
        print(note, file=sys.stderr)
    return builder.config, builder


def config_from_dict(data: dict[str, Any], source: str = "checkpoint") -> Config:
    builder = ConfigBuilder()
    builder.apply_mapping(data, source)
    return builder.config


def changed_settings(saved: Any, cfg: Config, shown: int = 8) -> Optional[str]:
    """What a resumed run changed against the settings its checkpoint was written with (``saved``: the
    checkpoint's ``config``), as ``key old -> new; ...``; None where nothing changed (``run.resume`` aside).
    The run goes on with its own settings: the optimizers keep them over the checkpoint's."""
    before = flat_settings(saved)
    lines = [f"{key} {before[key]!r} -> {value!r}" for key, value in flat_settings(cfg.to_dict()).items()
             if key != "run.resume" and key in before and before[key] != value]
    if not lines:
        return None
    more = f"; and {len(lines) - shown} more" if len(lines) > shown else ""
    return "; ".join(lines[:shown]) + more


#: keys that may differ between the processes of one run: where files lie, how a process shows its progress,
#: and the machine it runs on; the simulator's section is not read by a real run
PER_PROCESS = frozenset({"data.path", "data.val_path", "data.hf_data_files", "model.activation_checkpointing",
                         "run.resume_from",
                         "run.dir", "run.name", "run.device",
                         "run.threads", "run.compile", "run.deterministic", "run.precision", "log.progress",
                         "log.wandb", "log.wandb_project", "log.wandb_entity", "log.wandb_mode", "log.plot"})


def shared_settings(cfg: Config) -> dict[str, Any]:
    """What every process of a torchrun job must agree on: every key but :data:`PER_PROCESS` (``section.key`` ->
    value), and loco's version."""
    from importlib.metadata import PackageNotFoundError, version

    out = {key: value for key, value in flat_settings(cfg.to_dict()).items()
           if not key.startswith("sim.") and key not in PER_PROCESS}
    try:
        out["loco version"] = version("loco")
    except PackageNotFoundError:  # run from a source tree that was never installed
        out["loco version"] = "unknown"
    return out


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


__all__ = ["PER_PROCESS", "Config", "ConfigError", "changed_settings", "config_from_dict", "dump_config", "load_config",
           "shared_settings"]
