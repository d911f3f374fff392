"""Configuration profiles and the one place that turns YAML + CLI flags into dataclasses.

A profile is YAML with one section per layer (``model``, ``cache``, ``scheduler``,
``server``); a flag given on the command line overrides the profile's key of the same name.
Unknown sections or keys are errors, so a typo never silently falls back to a default.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

PROFILE_DIR = Path(__file__).parent
DEFAULT_PROFILE = PROFILE_DIR / "cpu.yaml"


def read_profile(path: str | Path | None) -> dict[str, dict[str, Any]]:
    path = Path(path) if path is not None else DEFAULT_PROFILE
    if not path.is_file():
        raise ValueError(f"config file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"{path}: expected sections of key: value mappings")
    return data


def build_section(cls: type, section: str, profile: dict[str, dict[str, Any]],
                  overrides: dict[str, Any]) -> Any:
    """Instantiate dataclass ``cls`` from ``profile[section]`` updated by non-None ``overrides``."""
    known = {f.name for f in dataclasses.fields(cls)}
    values = dict(profile.get(section, {}))
    unknown = set(values) - known
    if unknown:
        raise ValueError(f"unknown key(s) in section {section!r}: {', '.join(sorted(unknown))}")
    values.update({k: v for k, v in overrides.items() if k in known and v is not None})
    return cls(**values)


def check_sections(profile: dict[str, dict[str, Any]], sections: set[str]) -> None:
    unknown = set(profile) - sections
    if unknown:
        raise ValueError(f"unknown config section(s): {', '.join(sorted(unknown))}")
