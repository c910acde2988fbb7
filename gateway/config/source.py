"""Where the configuration comes from, and what of it is in force now (a reload's two ends:
SIGHUP and ``POST /admin/reload``, ``gateway.admin.reload``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.config.settings import Settings

SettingsLoader = Callable[[], Settings]


@dataclass
class ConfigSource:
    """``load`` reads the configuration again; ``current`` is what of it is in force (a reload
    replaces the settings that apply live; the others keep their running value)."""

    load: SettingsLoader
    current: Settings
