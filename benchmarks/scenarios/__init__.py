"""The scenario registry: one module per scenario, each with a SCENARIO."""

from __future__ import annotations

import importlib

from ..core import Scenario

# Order in which the runner executes and reports them.
NAMES = ("tcp_s2c", "tls_s2c", "busy", "c2s", "burst", "echo", "rpc", "frames", "retention", "idle",
         "httpx_download", "httpx_requests", "httpx_idle")


def get_scenario(name: str) -> Scenario:
    if name not in NAMES:
        raise KeyError(f"unknown scenario {name!r}; known: {', '.join(NAMES)}")
    module = importlib.import_module(f"{__name__}.{name}")
    scenario: Scenario = module.SCENARIO
    return scenario


def all_scenarios() -> list[Scenario]:
    return [get_scenario(name) for name in NAMES]
