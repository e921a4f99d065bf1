"""NVIDIA's Xid catalog (facts gpu-health.md §1) and the default effect of each bucket; docs/health.md's table.

Set ``TESSERA_UPDATE_DOCS=1`` to rewrite the generated table in docs/health.md from the code.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agent.core.health import (
    DEFAULT_EFFECT,
    NVIDIA_IGNORED_XIDS,
    HealthPolicy,
    XidEffect,
    default_effect,
    effect_table_markdown,
    nvidia_effect,
)
from agent.core.xid_catalog import (
    CATALOG,
    ENGINE_RESTART_APP_XIDS,
    IGNORE_XIDS,
    LAST_CATALOGUED_XID,
    NO_BUCKET_XIDS,
    RESET_GPU_XIDS,
    RESTART_APP_XIDS,
    RESTART_BM_XIDS,
    RESTART_VM_XIDS,
    WORKFLOW_XIDS,
    XidAction,
    immediate_action,
    lookup,
)

A = XidAction
# facts §1.2, the per-XID table: XID -> the catalog's immediate action
FACTS_TABLE = {
    8: A.RESTART_APP,
    13: A.RESTART_APP,
    31: A.RESTART_APP,
    32: A.RESTART_APP,
    38: A.IGNORE,
    43: A.IGNORE,
    45: A.WORKFLOW_XID_45,
    46: A.RESET_GPU,
    48: A.WORKFLOW_XID_48,
    61: A.CONTACT_SUPPORT,
    62: A.RESET_GPU,
    63: A.IGNORE,
    64: A.RESET_GPU,
    68: A.RESTART_APP,
    69: A.RESTART_APP,
    74: A.WORKFLOW_NVLINK_ERR,
    79: A.RESTART_BM,
    92: A.IGNORE,
    94: A.RESTART_APP,
    95: A.RESET_GPU,
    109: A.RESET_GPU,
    110: A.RESET_GPU,
    119: A.RESET_GPU,
    120: A.RESET_GPU,
    121: A.IGNORE,
    123: A.CONTACT_SUPPORT,
    136: A.RESET_GPU,
    137: A.IGNORE,
    140: A.RESET_GPU,
    143: A.RESET_GPU,
    **dict.fromkeys(range(144, 151), A.WORKFLOW_NVLINK5_ERR),
    151: A.RESTART_VM,
    154: A.XID_154,
    155: A.RESET_GPU,
    156: A.RESET_GPU,
    157: A.IGNORE,
    158: A.RESET_GPU,
    159: A.CHECK_UVM,
    160: A.IGNORE,  # the catalog; NVSentinel says RESTART_BM
    161: A.IGNORE,
    **dict.fromkeys(range(162, 173), A.NO_BUCKET),  # the catalog gives none; NVSentinel says RESET_GPU for 162
}


@pytest.mark.parametrize(("xid", "action"), sorted(FACTS_TABLE.items()))
def test_each_xid_in_the_facts_table_has_the_catalogs_immediate_action(xid: int, action: XidAction):
    assert lookup(xid).action is action
    assert immediate_action(xid)[0] is action


def test_the_bucket_lists_are_the_catalogs():
    assert frozenset({46, 62, 64, 95, 109, 110, 119, 120, 136, 140, 143, 155, 156, 158}) == RESET_GPU_XIDS
    assert RESTART_BM_XIDS == {79} == {x for x, i in CATALOG.items() if i.action is A.RESTART_BM}
    assert RESTART_VM_XIDS == {151} == {x for x, i in CATALOG.items() if i.action is A.RESTART_VM}
    assert frozenset(range(162, 173)) == NO_BUCKET_XIDS
    assert {45, 48, 74, *range(144, 151)} == WORKFLOW_XIDS
    assert {x for x, i in CATALOG.items() if i.action is A.XID_154} == {154}


def test_the_per_engine_exceptions_are_restart_app():
    listed = {39, 40, 41, 60, 68, 70, 71, 72, 75, 76, 77, 82, 83, 84, 85, 86, 88, 89, *range(96, 106)}
    assert frozenset(listed | set(range(126, 136)) | {139}) == ENGINE_RESTART_APP_XIDS
    assert ENGINE_RESTART_APP_XIDS <= RESTART_APP_XIDS
    assert {lookup(x).action for x in ENGINE_RESTART_APP_XIDS} == {A.RESTART_APP}


def test_the_catalog_lists_every_code_from_1_to_172_once():
    assert sorted(CATALOG) == list(range(1, LAST_CATALOGUED_XID + 1))
    assert LAST_CATALOGUED_XID == 172
    assert all(CATALOG[x].xid == x and CATALOG[x].short_name for x in CATALOG)


@pytest.mark.parametrize("xid", [0, 173, 255, 999, 2**32 - 1])
def test_a_code_outside_the_catalog_is_unknown_and_makes_the_device_unhealthy(xid: int):
    info = lookup(xid)
    assert info.action is A.UNKNOWN and not info.known and info.mnemonic is None
    assert default_effect(xid) is XidEffect.UNHEALTHY


def test_999_says_nvml_could_not_name_the_xid():
    assert immediate_action(999) == (A.UNKNOWN, "XID unknown to NVML")


def test_immediate_action_gives_the_mnemonic_or_else_the_short_name():
    assert immediate_action(48) == (A.WORKFLOW_XID_48, "ROBUST_CHANNEL_GPU_ECC_DBE")
    assert immediate_action(79) == (A.RESTART_BM, "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS")
    assert immediate_action(162) == (A.NO_BUCKET, "Power smoothing circuitry re-engaged")
    assert lookup(137).mnemonic == "NVLINK_PRIV_ERR"  # the catalog's name, not NVSentinel's
    assert lookup(108).mnemonic == "NVLINK_REMOTE_TRANSLATION_ERROR"


# ----- the default effect of each bucket ---------------------------------------------------------------


def test_every_action_has_a_default_effect():
    assert set(DEFAULT_EFFECT) == set(XidAction)


def test_application_level_buckets_leave_the_device_healthy():
    for xid in RESTART_APP_XIDS | IGNORE_XIDS:
        assert not default_effect(xid).marks_unhealthy, xid
    assert {default_effect(x) for x in IGNORE_XIDS} == {XidEffect.IGNORE}
    assert {default_effect(x) for x in RESTART_APP_XIDS} == {XidEffect.APPLICATION}


def test_reset_class_buckets_make_the_device_unhealthy():
    for xid in RESET_GPU_XIDS | NO_BUCKET_XIDS | {48, 74, 144, 150, 154, 159, 54, 78, 1, 61}:
        assert default_effect(xid) is XidEffect.UNHEALTHY, xid


def test_reboot_class_buckets_mark_the_gpu_lost():
    assert {x for x in range(0, 1000) if default_effect(x) is XidEffect.LOST} == {79, 151}


def test_the_differences_from_nvidias_plugin_are_where_the_catalog_says_application_or_reset():
    differ = {x for x in CATALOG if default_effect(x).marks_unhealthy != nvidia_effect(x).marks_unhealthy}
    assert 94 in differ and 109 in differ and 8 in differ and 63 in differ
    assert not differ & {13, 31, 43, 45, 68, 48, 79}  # both agree there
    # every difference is an application-level XID NVIDIA marks, or 109 (the one reset XID NVIDIA ignores)
    assert differ == ((RESTART_APP_XIDS | IGNORE_XIDS) - NVIDIA_IGNORED_XIDS) | {109}


# docs/health.md's rule, written out here rather than read from the code under test: what the application
# causes or needs no action leaves the device in service; the reboot class loses the GPU; all else is Unhealthy
E = XidEffect
DOCUMENTED_EFFECT = {A.IGNORE: E.IGNORE, A.RESTART_APP: E.APPLICATION, A.WORKFLOW_XID_45: E.APPLICATION,
                     A.RESTART_BM: E.LOST, A.RESTART_VM: E.LOST}  # fmt: skip


def test_the_policy_default_is_the_catalog_default():
    """A policy built with no flag, env or config gives every XID its catalog action's documented effect."""
    policy = HealthPolicy()
    expected = {x: DOCUMENTED_EFFECT.get(lookup(x).action, E.UNHEALTHY) for x in [*range(0, 400), 999, 2**32 - 1]}
    assert {x: policy.effect(x) for x in expected} == expected
    # the catalog's own facts, spot-checked without the lookup: 45 (killed app) and 94 (contained ECC) stay
    # in service, 48 (double-bit ECC) and 999 (unnamed) do not, 79 (off the bus) and 151 lose the GPU
    assert [policy.effect(x) for x in (43, 45, 94, 48, 999, 79, 151)] == [
        E.IGNORE, E.APPLICATION, E.APPLICATION, E.UNHEALTHY, E.UNHEALTHY, E.LOST, E.LOST]  # fmt: skip


# ----- docs/health.md ------------------------------------------------------------------------------------

DOC = Path(__file__).resolve().parents[2] / "docs" / "health.md"
BEGIN, END = "<!-- xid-table:begin", "<!-- xid-table:end -->"


def _split(text: str) -> tuple[str, str, str]:
    begin = text.index("\n", text.index(BEGIN)) + 1
    end = text.index(END)
    return text[:begin], text[begin:end], text[end:]


def test_the_documented_table_is_the_one_the_code_uses():
    text = DOC.read_text(encoding="utf-8")
    head, table, tail = _split(text)
    generated = effect_table_markdown()
    if table != generated and os.environ.get("TESSERA_UPDATE_DOCS") == "1":
        DOC.write_text(head + generated + tail, encoding="utf-8")
        table = generated
    assert table == generated, (
        "docs/health.md's XID table differs from agent/core/health.py; "
        "rerun with TESSERA_UPDATE_DOCS=1 to regenerate it"
    )


def test_the_documented_table_has_a_row_per_xid_with_its_action_and_effect():
    _, table, _ = _split(DOC.read_text(encoding="utf-8"))
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells
    for xid, info in CATALOG.items():
        cells = rows[str(xid)]
        assert cells[3] == info.action.value
        assert cells[4].removesuffix(" **≠**") == default_effect(xid).value
        assert cells[5] == nvidia_effect(xid).value
    assert rows["other, 999"][3:5] == ["UNKNOWN", "unhealthy"]


def test_the_docs_name_every_effect_and_the_override_syntax():
    text = DOC.read_text(encoding="utf-8")
    for effect in XidEffect:
        assert f"`{effect.value}`" in text
    for needle in ("--xid-overrides", "health:", "xids:", "DP_DISABLE_HEALTHCHECKS", "DP_ENABLE_HEALTHCHECKS"):
        assert needle in text
