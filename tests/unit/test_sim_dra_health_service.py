"""Which health stream the DRA kubelet emulator opens, release by release (facts/dra.md A4 and E)."""

from __future__ import annotations

import pytest

from agent.sim.kubelet.dra_versions import rules_for

V1, V1ALPHA1 = "v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"
PLUGIN = ["v1.DRAPlugin", "v1beta1.DRAPlugin"]


@pytest.mark.parametrize(
    ("kubelet", "offered", "stream"),
    [
        ("1.33", [*PLUGIN, V1, V1ALPHA1], None),  # no health stream before 1.34
        ("1.34", PLUGIN, V1ALPHA1),  # 1.34-1.36 open v1alpha1 whether or not the plugin advertises it
        ("1.36", [*PLUGIN, V1, V1ALPHA1], V1ALPHA1),  # ... and know nothing of v1
        ("1.37", [*PLUGIN, V1ALPHA1, V1], V1),  # 1.37 prefers v1 whatever the plugin's order
        ("1.37", [*PLUGIN, V1ALPHA1], V1ALPHA1),  # a driver that predates v1
        ("1.37", PLUGIN, None),  # only for plugins that advertise a health service
    ],
)
def test_the_health_service_the_kubelet_streams(kubelet: str, offered: list[str], stream: str | None) -> None:
    assert rules_for(kubelet).health_service(offered) == stream
