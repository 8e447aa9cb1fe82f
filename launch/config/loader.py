"""Building a config in layers: code defaults, then each ``--config FILE`` in order (files hold only differences
from the defaults; a preset is named by its file under ``configs/``), then each ``--set a.b=value``.

Every value is converted to its field's type and checked against the field's bounds as it is set, and remembers
where it came from, so an error names the file (or the ``--set`` flag), the key, and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from diloco.sim.units import parse_duration
from launch.config.schema import RETIRED, SECTIONS, Config, ConfigError


def format_duration(seconds: float) -> str:
    for unit, size in (("h", 3600.0), ("m", 60.0)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _type_name(args[0]) + " or empty (null)"
    if origin is tuple:
        return "a list of " + str(len(typing.get_args(tp))) + " numbers"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _coerce(value: Any, tp: Any, meta: dict[str, Any]) -> Any:
    """Convert ``value`` to ``tp`` or raise ValueError with what is allowed."""
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.strip().lower() in ("", "null", "none", "~")):
            return None
        if meta.get("auto") and isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            return _coerce(value, args[0], meta)
        except ValueError as e:
            if meta.get("auto"):  # a number or the word auto
                raise ValueError(f"got {value!r}, expected a positive integer, auto or empty (null)") from None
            raise e
    if meta.get("duration"):
        try:
            return parse_duration(value)
        except ValueError as e:
            raise ValueError(str(e)) from None
    if origin is Literal:
        allowed = typing.get_args(tp)
        if isinstance(value, bool):  # YAML reads off/on/yes/no as booleans
            value = next((w for w in (("on", "yes", "true") if value else ("off", "no", "false")) if w in allowed), value)
        if value not in allowed:
            raise ValueError(f"got {value!r}, allowed: {', '.join(str(a) for a in allowed)}")
        return value
    if origin is tuple:
        args = typing.get_args(tp)
        if isinstance(value, str):
            value = [v for v in re.split(r"[,\s]+", value.strip("[]() ")) if v]
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ValueError(f"got {value!r}, expected {_type_name(tp)}")
        return tuple(_coerce(v, a, {}) for v, a in zip(value, args))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            return value.lower() in ("true", "yes", "on", "1")
        raise ValueError(f"got {value!r}, expected true or false")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"got {value!r}, expected an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                try:  # 1e3
                    as_float = float(value)
                except ValueError:
                    as_float = None
                if as_float is not None and as_float.is_integer():
                    return int(as_float)
        raise ValueError(f"got {value!r}, expected an integer")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"got {value!r}, expected a number")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:  # YAML 1.1 reads 1e-3 as a string
                return float(value)
            except ValueError:
                pass
        raise ValueError(f"got {value!r}, expected a number")
    if tp is str:
        if value is None:
            raise ValueError("empty, expected a string")
        if isinstance(value, (dict, list, bool)):
            raise ValueError(f"got {value!r}, expected a string (quote it in YAML)")
        return str(value)
    raise ValueError(f"unsupported config type {tp}")


def _check_bounds(value: Any, meta: dict[str, Any]) -> None:
    if value is None or not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"got {value}, expected a finite number")
    for key, ok, word in (
        ("gt", lambda v, b: v > b, ">"),
        ("ge", lambda v, b: v >= b, ">="),
        ("lt", lambda v, b: v < b, "<"),
        ("le", lambda v, b: v <= b, "<="),
    ):
        if key in meta and not ok(value, meta[key]):
            raise ValueError(f"got {value}, must be {word} {meta[key]}")


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


class ConfigBuilder:
    """Applies layers of values to a Config, remembering the source of each key."""

    def __init__(self) -> None:
        self.config = Config()
        self.sources: dict[str, str] = {}
        self.retired: dict[str, str] = {}  # retired key -> where it was set
        self.keys_of: dict[str, set[str]] = {}  # source -> every key it set, later layers notwithstanding

    def _field(self, section: str, key: str, source: str) -> dataclasses.Field:
        if section not in SECTIONS:
            raise ConfigError(
                f"{source}: unknown section '{section}'{_suggest(section, list(SECTIONS))}; "
                f"sections are: {', '.join(SECTIONS)}"
            )
        fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
        if key not in fields:
            raise ConfigError(
                f"{source}: unknown key '{section}.{key}'{_suggest(key, list(fields))}; "
                f"keys in '{section}' are: {', '.join(fields)}"
            )
        return fields[key]

    def set(self, dotted: str, value: Any, source: str) -> None:
        parts = dotted.split(".")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"{source}: key '{dotted}' must look like section.key (for example optim.lr)")
        section, key = parts
        if dotted in RETIRED:
            self.retired[dotted] = source
            return
        f = self._field(section, key, source)
        hints = typing.get_type_hints(SECTIONS[section])
        try:
            coerced = _coerce(value, hints[key], dict(f.metadata))
            _check_bounds(coerced, dict(f.metadata))
        except ValueError as e:
            raise ConfigError(f"{source}: {dotted}: {e} ({f.metadata.get('doc', '')})") from None
        setattr(getattr(self.config, section), key, coerced)
        self.sources[dotted] = source
        self.keys_of.setdefault(source, set()).add(dotted)

    def apply_mapping(self, data: Any, source: str) -> None:
        if data is None:
            return
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: the top level must be a mapping of sections (model:, data:, ...), got {type(data).__name__}")
        for section, values in data.items():
            if section not in SECTIONS:
                raise ConfigError(
                    f"{source}: unknown section '{section}'{_suggest(str(section), list(SECTIONS))}; "
                    f"sections are: {', '.join(SECTIONS)}"
                )
            if values is None:
                continue
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: section '{section}' must be a mapping of keys, got {values!r}")
            for key, value in values.items():
                self.set(f"{section}.{key}", value, source)

    def apply_file(self, path: str | Path, _chain: tuple[Path, ...] = ()) -> None:
        """Apply a YAML file; ``extends: other.yaml`` (relative to this file) applies that file first."""
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{p}: config file not found")
        try:
            data = yaml.safe_load(p.read_text(encoding="utf-8"))
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {e}") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{p}: not a YAML text file (not UTF-8): name a .yaml config") from None
        except OSError as e:
            raise ConfigError(f"{p}: cannot be read: {e.strerror or e}") from None
        if isinstance(data, dict) and "extends" in data:
            parent = (p.parent / str(data.pop("extends"))).resolve()
            if parent in _chain or parent == p.resolve():
                raise ConfigError(f"{p}: extends {parent}, which extends it back (a cycle)")
            if not parent.is_file():
                raise ConfigError(f"{p}: extends: {parent} not found")
            self.apply_file(parent, _chain + (p.resolve(),))
        self.apply_mapping(data, str(p))

    def apply_override(self, text: str, source: str = "--set") -> None:
        if "=" not in text:
            raise ConfigError(f"{source} {text!r}: expected section.key=value (for example --set optim.lr=3e-4)")
        key, raw = text.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw
        self.set(key.strip(), value, f"{source} {text}")

    def retired_notes(self) -> list[str]:
        """One line for each retired key a layer set: where, and what to write instead."""
        return [f"{source}: {key} is no longer read: {RETIRED[key]}" for key, source in self.retired.items()]

    def unread_notes(self) -> list[str]:
        """One line for each algo.* key the user's own file or --set gives and the chosen algorithm does not read.
        A preset under configs/ is silent (configs/sparseloco.yaml inherits tiny's outer momentum), and so is a
        file that sets every algo key: a run's config.yaml, the record of its settings rather than a choice."""
        from launch.config.algorithms import reads

        name = self.config.algo.name
        read = reads(name)
        if read is None:
            return []
        every = {f"algo.{f.name}" for f in dataclasses.fields(SECTIONS["algo"])}
        records = {source for source, keys in self.keys_of.items() if every <= keys}
        notes = []
        for f in dataclasses.fields(SECTIONS["algo"]):
            key, source = f"algo.{f.name}", self.where(f"algo.{f.name}")
            if f.name in read or f.name == "name" or source in records or not _users(source):
                continue
            notes.append(f"{source}: {name} does not read {key} ({f.metadata.get('doc', '').rstrip('.')})")
        return notes

    def where(self, dotted: str) -> str:
        return self.sources.get(dotted, "default")


def _users(source: str) -> bool:
    """Whether a layer is the user's own: --set or a flag, or a file that is not a preset under configs/."""
    if source == "default":
        return False
    return source.startswith("--") or Path(source).resolve().parent != PRESETS_DIR


def resolve_config_path(name: str) -> str:
    """A file path as given, or a preset name: 'tiny' -> <checkout>/configs/tiny.yaml."""
    if Path(name).exists() or "/" in name or name.endswith((".yaml", ".yml")):
        return name
    preset = PRESETS_DIR / f"{name}.yaml"
    return str(preset) if preset.is_file() else name


PRESETS_DIR = Path(__file__).resolve().parents[2] / "configs"
