"""NVIDIA's Xid catalog: the immediate action the catalog gives for each XID (Ampere and newer).

Source: the "Analyzing Xid Catalog" page and its spreadsheet (``facts/gpu-health.md`` §1). Each XID has a
*Resolution Bucket (Immediate Action)*; that bucket is what this module returns. Where the page the facts
were read from does not list a code's row, NVIDIA's own derived table (NVSentinel ``xiderrorsmapping.csv``)
fills it, read with the facts' corrections: its ``UNEXPECTED_ERR_REPORT_ISSUE`` is the catalog's
``CONTACT_SUPPORT``, 160 is ``IGNORE`` (the catalog) not ``RESTART_BM``, and 162 has no bucket (the catalog)
rather than ``RESET_GPU``. Short names follow the catalog's descriptions (dcgm-exporter's wording where the
catalog says only "Unused").

Two kinds of code are not catalogued buckets, and say so instead of pretending:
- ``NO_BUCKET``: listed (162-172, newer Blackwell codes) but without an immediate action;
- ``UNKNOWN``: not in the catalog at all, including 999, which NVML reports for an XID it cannot name.

What a bucket *means for device health* is decided in ``agent.core.health``, not here. Pure and immutable.
"""

from __future__ import annotations

from enum import StrEnum
from types import MappingProxyType

from msgspec import Struct


class XidAction(StrEnum):
    """The catalog's immediate-action buckets, plus the two ways a code can lack one."""

    IGNORE = "IGNORE"  # no action
    RESTART_APP = "RESTART_APP"  # restart the application; no reset or reboot needed
    RESET_GPU = "RESET_GPU"  # reset the GPU; reboot if that does not clear it
    RESTART_BM = "RESTART_BM"  # restart the node (bare metal): only Xid 79
    RESTART_VM = "RESTART_VM"  # restart the VM that owns the GPU: Xid 151
    CONTACT_SUPPORT = "CONTACT_SUPPORT"  # escalate; every "Unused" code has it
    CHECK_MECHANICALS = "CHECK_MECHANICALS"  # seating and power connectors
    UPDATE_SWFW = "UPDATE_SWFW"  # update driver or firmware
    CHECK_UVM = "CHECK_UVM"  # RESET_GPU when UVM/vGPU is in use, else IGNORE
    WORKFLOW_XID_45 = "WORKFLOW_XID_45"  # alone: restart Fabric Manager; with other XIDs: follow those
    WORKFLOW_XID_48 = "WORKFLOW_XID_48"  # alone: RESET_GPU; with 63/64: drain and reset
    WORKFLOW_NVLINK_ERR = "WORKFLOW_NVLINK_ERR"  # decode the register bits of the message (Xid 74)
    WORKFLOW_NVLINK5_ERR = "WORKFLOW_NVLINK5_ERR"  # per subcode IGNORE / RESET_GPU / XID_154_EVAL (144-150)
    XID_154 = "XID_154"  # follow the recovery action that Xid 154 announces
    NO_BUCKET = "NO_BUCKET"  # catalogued, but the catalog gives no immediate action (162-172)
    UNKNOWN = "UNKNOWN"  # not in the catalog (or 999: NVML could not name the XID)


class XidInfo(Struct, frozen=True):
    xid: int
    action: XidAction
    mnemonic: str | None  # the catalog's mnemonic, e.g. ROBUST_CHANNEL_GPU_ECC_DBE; None where unknown
    short_name: str  # a few words, e.g. "Double Bit ECC Error"

    @property
    def name(self) -> str:
        """The mnemonic when known, else the short name."""
        return self.mnemonic or self.short_name

    @property
    def known(self) -> bool:
        return self.action is not XidAction.UNKNOWN


XID_UNKNOWN_TO_NVML = 999  # eventData of an XID event whose number NVML could not decode

_A = XidAction
# (xid, mnemonic, short name, immediate action)
_ROWS: tuple[tuple[int, str | None, str, XidAction], ...] = (
    (1, "ROBUST_CHANNEL_FIFO_ERROR_FIFO_METHOD", "Invalid or corrupted push buffer stream", _A.CONTACT_SUPPORT),
    (2, "ROBUST_CHANNEL_FIFO_ERROR_SW_METHOD", "Invalid or corrupted push buffer stream", _A.CONTACT_SUPPORT),
    (3, "ROBUST_CHANNEL_FIFO_ERROR_UNK_METHOD", "Invalid or corrupted push buffer stream", _A.CONTACT_SUPPORT),
    (4, "ROBUST_CHANNEL_FIFO_ERROR_CHANNEL_BUSY", "Invalid or corrupted push buffer stream", _A.CONTACT_SUPPORT),
    (5, "ROBUST_CHANNEL_FIFO_ERROR_RUNOUT_OVERFLOW", "Unused", _A.CONTACT_SUPPORT),
    (6, "ROBUST_CHANNEL_FIFO_ERROR_PARSE_ERR", "Invalid or corrupted push buffer stream", _A.CONTACT_SUPPORT),
    (7, "ROBUST_CHANNEL_FIFO_ERROR_PTE_ERR", "Invalid or corrupted push buffer address", _A.CONTACT_SUPPORT),
    (8, "ROBUST_CHANNEL_FIFO_ERROR_IDLE_TIMEOUT", "GPU stopped processing", _A.RESTART_APP),
    (9, "ROBUST_CHANNEL_GR_ERROR_INSTANCE", "Driver error programming GPU", _A.CONTACT_SUPPORT),
    (10, "ROBUST_CHANNEL_GR_ERROR_SINGLE_STEP", "Unused", _A.CONTACT_SUPPORT),
    (11, "ROBUST_CHANNEL_GR_ERROR_MISSING_HW", "Invalid or corrupted push buffer stream", _A.RESTART_APP),
    (12, "ROBUST_CHANNEL_GR_ERROR_SW_METHOD", "Driver error handling GPU exception", _A.CONTACT_SUPPORT),
    (13, "ROBUST_CHANNEL_GR_EXCEPTION", "Graphics Engine Exception", _A.RESTART_APP),
    (14, "ROBUST_CHANNEL_FAKE_ERROR", "Unused", _A.IGNORE),
    (15, "ROBUST_CHANNEL_SCANLINE_TIMEOUT", "Unused", _A.CONTACT_SUPPORT),
    (16, "ROBUST_CHANNEL_VBLANK_CALLBACK_TIMEOUT", "Display engine hung", _A.CONTACT_SUPPORT),
    (17, "ROBUST_CHANNEL_PARAMETER_ERROR", "Unused", _A.CONTACT_SUPPORT),
    (18, "ROBUST_CHANNEL_BUS_MASTER_TIMEOUT_ERROR", "Bus mastering disabled in PCI config space", _A.CONTACT_SUPPORT),
    (19, "ROBUST_CHANNEL_DISP_MISSED_NOTIFIER", "Display engine error", _A.CONTACT_SUPPORT),
    (20, "ROBUST_CHANNEL_MPEG_ERROR_SW_METHOD", "Invalid or corrupted MPEG push buffer", _A.CONTACT_SUPPORT),
    (21, "ROBUST_CHANNEL_ME_ERROR_SW_METHOD", "Invalid or corrupted motion estimation push buffer", _A.CONTACT_SUPPORT),
    (22, "ROBUST_CHANNEL_VP_ERROR_SW_METHOD", "Invalid or corrupted video processor push buffer", _A.CONTACT_SUPPORT),
    (23, "ROBUST_CHANNEL_RC_LOGGING_ENABLED", "Unused", _A.CONTACT_SUPPORT),
    (24, "ROBUST_CHANNEL_GR_SEMAPHORE_TIMEOUT", "GPU semaphore timeout", _A.CONTACT_SUPPORT),
    (25, "ROBUST_CHANNEL_GR_ILLEGAL_NOTIFY", "Invalid or illegal push buffer stream", _A.RESTART_APP),
    (26, "ROBUST_CHANNEL_FIFO_ERROR_FBISTATE_TIMEOUT", "Framebuffer timeout", _A.CONTACT_SUPPORT),
    (27, "ROBUST_CHANNEL_VP_ERROR", "Video processor exception", _A.CONTACT_SUPPORT),
    (28, "ROBUST_CHANNEL_VP2_ERROR", "Video processor exception", _A.CONTACT_SUPPORT),
    (29, "ROBUST_CHANNEL_BSP_ERROR", "Video processor exception", _A.CONTACT_SUPPORT),
    (30, "ROBUST_CHANNEL_BAD_ADDR_ACCESS", "GPU semaphore access error", _A.CONTACT_SUPPORT),
    (31, "ROBUST_CHANNEL_FIFO_ERROR_MMU_ERR_FLT", "GPU memory page fault", _A.RESTART_APP),
    (32, "ROBUST_CHANNEL_PBDMA_ERROR", "Invalid or corrupted push buffer stream", _A.RESTART_APP),
    (33, "ROBUST_CHANNEL_SEC_ERROR", "Internal micro-controller error", _A.CONTACT_SUPPORT),
    (34, "ROBUST_CHANNEL_MSVLD_ERROR", "Video processor exception", _A.CONTACT_SUPPORT),
    (35, "ROBUST_CHANNEL_MSPDEC_ERROR", "Video processor exception", _A.CONTACT_SUPPORT),
    (36, "ROBUST_CHANNEL_MSPPP_ERROR", "Video processor exception", _A.CONTACT_SUPPORT),
    (37, "ROBUST_CHANNEL_FECS_ERR_UNIMP_FIRMWARE_METHOD", "Driver firmware error", _A.IGNORE),
    (38, "ROBUST_CHANNEL_FECS_ERR_WATCHDOG_TIMEOUT", "Driver firmware error", _A.IGNORE),
    (39, "ROBUST_CHANNEL_CE0_ERROR", "Copy engine 0 exception", _A.RESTART_APP),
    (40, "ROBUST_CHANNEL_CE1_ERROR", "Copy engine 1 exception", _A.RESTART_APP),
    (41, "ROBUST_CHANNEL_CE2_ERROR", "Copy engine 2 exception", _A.RESTART_APP),
    (42, "ROBUST_CHANNEL_VIC_ERROR", "Video processor exception", _A.CONTACT_SUPPORT),
    (43, "ROBUST_CHANNEL_RESETCHANNEL_VERIF_ERROR", "GPU stopped processing", _A.IGNORE),
    (44, "ROBUST_CHANNEL_GR_FAULT_DURING_CTXSW", "Graphics engine fault during context switch", _A.IGNORE),
    (45, "ROBUST_CHANNEL_PREEMPTIVE_REMOVAL", "Preemptive cleanup after earlier errors", _A.WORKFLOW_XID_45),
    (46, "ROBUST_CHANNEL_GPU_TIMEOUT_ERROR", "GPU stopped processing", _A.RESET_GPU),
    (47, "ROBUST_CHANNEL_NVENC0_ERROR", "Video processor exception", _A.CONTACT_SUPPORT),
    (48, "ROBUST_CHANNEL_GPU_ECC_DBE", "Double Bit ECC Error", _A.WORKFLOW_XID_48),
    (49, "SILENT_RUNNING_CONSTANT_LEVEL_SET_BY_REGISTRY", "Unused", _A.CONTACT_SUPPORT),
    (50, "SILENT_RUNNING_LEVEL_TRANSITION_DUE_TO_RC_ERROR", "Unused", _A.CONTACT_SUPPORT),
    (51, "SILENT_RUNNING_STRESS_TEST_FAILURE", "Unused", _A.CONTACT_SUPPORT),
    (52, "SILENT_RUNNING_LEVEL_TRANS_DUE_TO_TEMP_RISE", "Unused", _A.CONTACT_SUPPORT),
    (53, "SILENT_RUNNING_TEMP_REDUCED_CLOCKING", "Unused", _A.CONTACT_SUPPORT),
    (54, "SILENT_RUNNING_PWR_REDUCED_CLOCKING", "Auxiliary power not connected", _A.CHECK_MECHANICALS),
    (55, "SILENT_RUNNING_TEMPERATURE_READ_ERROR", "Unused", _A.CONTACT_SUPPORT),
    (56, "DISPLAY_CHANNEL_EXCEPTION", "Display engine error", _A.CONTACT_SUPPORT),
    (57, "FB_LINK_TRAINING_FAILURE_ERROR", "Error programming video memory interface", _A.CONTACT_SUPPORT),
    (58, "FB_MEMORY_ERROR", "Unstable video memory interface", _A.CONTACT_SUPPORT),
    (59, "PMU_ERROR", "Internal micro-controller error", _A.CONTACT_SUPPORT),
    (60, "ROBUST_CHANNEL_SEC2_ERROR", "SEC2 engine exception", _A.RESTART_APP),
    (61, "PMU_BREAKPOINT", "Internal micro-controller breakpoint (unused on A100+)", _A.CONTACT_SUPPORT),
    (62, "PMU_HALT_ERROR", "Internal micro-controller halt", _A.RESET_GPU),
    (63, "INFOROM_DRAM_RETIREMENT_EVENT", "Memory remap / page retirement event", _A.IGNORE),
    (64, "INFOROM_DRAM_RETIREMENT_FAILURE", "Memory remap / page retirement failure", _A.RESET_GPU),
    (65, "ROBUST_CHANNEL_NVENC1_ERROR", "Video processor exception", _A.CONTACT_SUPPORT),
    (66, "ROBUST_CHANNEL_FECS_ERR_REG_ACCESS_VIOLATION", "Illegal access by driver", _A.IGNORE),
    (67, "ROBUST_CHANNEL_FECS_ERR_VERIF_VIOLATION", "Illegal access by driver", _A.IGNORE),
    (68, "ROBUST_CHANNEL_NVDEC0_ERROR", "NVDEC0 exception", _A.RESTART_APP),
    (69, "ROBUST_CHANNEL_GR_CLASS_ERROR", "Graphics engine class error", _A.RESTART_APP),
    (70, "ROBUST_CHANNEL_CE3_ERROR", "Copy engine 3 exception", _A.RESTART_APP),
    (71, "ROBUST_CHANNEL_CE4_ERROR", "Copy engine 4 exception", _A.RESTART_APP),
    (72, "ROBUST_CHANNEL_CE5_ERROR", "Copy engine 5 exception", _A.RESTART_APP),
    (73, "ROBUST_CHANNEL_NVENC2_ERROR", "NVENC2 exception", _A.CONTACT_SUPPORT),
    (74, "NVLINK_ERROR", "NVLink error", _A.WORKFLOW_NVLINK_ERR),
    (75, "ROBUST_CHANNEL_CE6_ERROR", "Copy engine 6 exception", _A.RESTART_APP),
    (76, "ROBUST_CHANNEL_CE7_ERROR", "Copy engine 7 exception", _A.RESTART_APP),
    (77, "ROBUST_CHANNEL_CE8_ERROR", "Copy engine 8 exception", _A.RESTART_APP),
    (78, "VGPU_START_ERROR", "vGPU start error", _A.UPDATE_SWFW),
    (79, "ROBUST_CHANNEL_GPU_HAS_FALLEN_OFF_THE_BUS", "GPU has fallen off the bus", _A.RESTART_BM),
    (80, "PBDMA_PUSHBUFFER_CRC_MISMATCH", "Corrupted data sent to GPU", _A.RESTART_APP),
    (81, "ROBUST_CHANNEL_VGA_SUBSYSTEM_ERROR", "VGA subsystem error", _A.CONTACT_SUPPORT),
    (82, "ROBUST_CHANNEL_NVJPG0_ERROR", "NVJPG0 exception", _A.RESTART_APP),
    (83, "ROBUST_CHANNEL_NVDEC1_ERROR", "NVDEC1 exception", _A.RESTART_APP),
    (84, "ROBUST_CHANNEL_NVDEC2_ERROR", "NVDEC2 exception", _A.RESTART_APP),
    (85, "ROBUST_CHANNEL_CE9_ERROR", "Copy engine 9 exception", _A.RESTART_APP),
    (86, "ROBUST_CHANNEL_OFA0_ERROR", "OFA0 exception", _A.RESTART_APP),
    (87, "NVTELEMETRY_DRIVER_REPORT", "Reserved", _A.CONTACT_SUPPORT),
    (88, "ROBUST_CHANNEL_NVDEC3_ERROR", "NVDEC3 exception", _A.RESTART_APP),
    (89, "ROBUST_CHANNEL_NVDEC4_ERROR", "NVDEC4 exception", _A.RESTART_APP),
    (90, "LTC_ERROR", "Reserved", _A.CONTACT_SUPPORT),
    (91, "RESERVED_XID", "Reserved", _A.CONTACT_SUPPORT),
    (92, "EXCESSIVE_SBE_INTERRUPTS", "High single-bit ECC error rate", _A.IGNORE),
    (93, "INFOROM_ERASE_LIMIT_EXCEEDED", "InfoROM wear limit exceeded (non-fatal)", _A.IGNORE),
    (94, "ROBUST_CHANNEL_CONTAINED_ERROR", "Contained memory error", _A.RESTART_APP),
    (95, "ROBUST_CHANNEL_UNCONTAINED_ERROR", "Uncontained memory error", _A.RESET_GPU),
    (96, "ROBUST_CHANNEL_NVDEC5_ERROR", "NVDEC5 exception", _A.RESTART_APP),
    (97, "ROBUST_CHANNEL_NVDEC6_ERROR", "NVDEC6 exception", _A.RESTART_APP),
    (98, "ROBUST_CHANNEL_NVDEC7_ERROR", "NVDEC7 exception", _A.RESTART_APP),
    (99, "ROBUST_CHANNEL_NVJPG1_ERROR", "NVJPG1 exception", _A.RESTART_APP),
    (100, "ROBUST_CHANNEL_NVJPG2_ERROR", "NVJPG2 exception", _A.RESTART_APP),
    (101, "ROBUST_CHANNEL_NVJPG3_ERROR", "NVJPG3 exception", _A.RESTART_APP),
    (102, "ROBUST_CHANNEL_NVJPG4_ERROR", "NVJPG4 exception", _A.RESTART_APP),
    (103, "ROBUST_CHANNEL_NVJPG5_ERROR", "NVJPG5 exception", _A.RESTART_APP),
    (104, "ROBUST_CHANNEL_NVJPG6_ERROR", "NVJPG6 exception", _A.RESTART_APP),
    (105, "ROBUST_CHANNEL_NVJPG7_ERROR", "NVJPG7 exception", _A.RESTART_APP),
    (106, "SMBPBI_TEST_MESSAGE", "SMBPBI test message", _A.IGNORE),
    (107, "SMBPBI_TEST_MESSAGE_SILENT", "SMBPBI test message (silent)", _A.IGNORE),
    (108, "NVLINK_REMOTE_TRANSLATION_ERROR", "NVLink remote translation error", _A.CONTACT_SUPPORT),
    (109, "ROBUST_CHANNEL_CTXSW_TIMEOUT_ERROR", "Context switch timeout", _A.RESET_GPU),
    (110, "SEC_FAULT_ERROR", "Security fault", _A.RESET_GPU),
    (111, "BUNDLE_ERROR_EVENT", "Display bundle error", _A.CONTACT_SUPPORT),
    (112, "DISP_SUPERVISOR_ERROR", "Display supervisor error", _A.CONTACT_SUPPORT),
    (113, "DP_LT_FAILURE", "DisplayPort link training error", _A.CONTACT_SUPPORT),
    (114, "HEAD_RG_UNDERFLOW", "Display pipeline underflow", _A.CONTACT_SUPPORT),
    (115, "CORE_CHANNEL_REGS", "Display core channel error", _A.CONTACT_SUPPORT),
    (116, "WINDOW_CHANNEL_REGS", "Display window channel error", _A.CONTACT_SUPPORT),
    (117, "CURSOR_CHANNEL_REGS", "Display cursor channel error", _A.CONTACT_SUPPORT),
    (118, "HEAD_REGS", "Display pixel pipeline error", _A.CONTACT_SUPPORT),
    (119, "GSP_RPC_TIMEOUT", "GSP RPC timeout", _A.RESET_GPU),
    (120, "GSP_ERROR", "GSP error", _A.RESET_GPU),
    (121, "C2C_ERROR", "C2C link corrected errors", _A.IGNORE),
    (122, "SPI_PMU_RPC_READ_FAIL", "SPI PMU RPC read failure", _A.CONTACT_SUPPORT),
    (123, "SPI_PMU_RPC_WRITE_FAIL", "Unused (SPI PMU RPC write failure)", _A.CONTACT_SUPPORT),
    (124, "SPI_PMU_RPC_ERASE_FAIL", "SPI PMU RPC erase failure", _A.CONTACT_SUPPORT),
    (125, "INFOROM_FS_ERROR", "InfoROM file system failure", _A.CONTACT_SUPPORT),
    (126, "ROBUST_CHANNEL_CE10_ERROR", "Copy engine 10 exception", _A.RESTART_APP),
    (127, "ROBUST_CHANNEL_CE11_ERROR", "Copy engine 11 exception", _A.RESTART_APP),
    (128, "ROBUST_CHANNEL_CE12_ERROR", "Copy engine 12 exception", _A.RESTART_APP),
    (129, "ROBUST_CHANNEL_CE13_ERROR", "Copy engine 13 exception", _A.RESTART_APP),
    (130, "ROBUST_CHANNEL_CE14_ERROR", "Copy engine 14 exception", _A.RESTART_APP),
    (131, "ROBUST_CHANNEL_CE15_ERROR", "Copy engine 15 exception", _A.RESTART_APP),
    (132, "ROBUST_CHANNEL_CE16_ERROR", "Copy engine 16 exception", _A.RESTART_APP),
    (133, "ROBUST_CHANNEL_CE17_ERROR", "Copy engine 17 exception", _A.RESTART_APP),
    (134, "ROBUST_CHANNEL_CE18_ERROR", "Copy engine 18 exception", _A.RESTART_APP),
    (135, "ROBUST_CHANNEL_CE19_ERROR", "Copy engine 19 exception", _A.RESTART_APP),
    (136, "ALI_TRAINING_FAIL", "Link training failed", _A.RESET_GPU),
    (137, "NVLINK_PRIV_ERR", "NVLink privilege error (illegal P2P access)", _A.IGNORE),
    (138, "ROBUST_CHANNEL_DLA_ERROR", "DLA exception", _A.CONTACT_SUPPORT),
    (139, "ROBUST_CHANNEL_OFA1_ERROR", "OFA1 exception", _A.RESTART_APP),
    (140, "UNRECOVERABLE_ECC_ERROR_ESCAPE", "Unrecovered ECC error", _A.RESET_GPU),
    (141, "ROBUST_CHANNEL_FAST_PATH_ERROR", "Fast path error", _A.IGNORE),
    (142, "ROBUST_CHANNEL_NVENC3_ERROR", "NVENC3 exception", _A.CONTACT_SUPPORT),
    (143, "GPU_INIT_ERROR", "GPU initialization error", _A.RESET_GPU),
    (144, "NVLINK_SAW_ERROR", "NVLink SAW error", _A.WORKFLOW_NVLINK5_ERR),
    (145, "NVLINK_RLW_ERROR", "NVLink RLW error", _A.WORKFLOW_NVLINK5_ERR),
    (146, "NVLINK_TLW_ERROR", "NVLink TLW error", _A.WORKFLOW_NVLINK5_ERR),
    (147, "NVLINK_TREX_ERROR", "NVLink TREX error", _A.WORKFLOW_NVLINK5_ERR),
    (148, "NVLINK_NVLPW_CTRL_ERROR", "NVLink NVLPW_CTRL error", _A.WORKFLOW_NVLINK5_ERR),
    (149, "NVLINK_NETIR_ERROR", "NVLink NETIR error", _A.WORKFLOW_NVLINK5_ERR),
    (150, "NVLINK_MSE_ERROR", "NVLink MSE error", _A.WORKFLOW_NVLINK5_ERR),
    (151, "ROBUST_CHANNEL_KEY_ROTATION_ERROR", "Key rotation error (confidential computing)", _A.RESTART_VM),
    (152, "ROBUST_CHANNEL_DLA_SMMU_ERROR", "DLA SMMU error", _A.IGNORE),
    (153, "ROBUST_CHANNEL_DLA_TIMEOUT", "DLA timeout", _A.IGNORE),
    (154, "GPU_RECOVERY_ACTION_CHANGED", "GPU recovery action changed", _A.XID_154),
    (155, "NVLINK_SW_DEFINED_ERROR", "Intentional NVLink down", _A.RESET_GPU),
    (156, "RESOURCE_RETIREMENT_EVENT", "Resource retirement event", _A.RESET_GPU),
    (157, "RESOURCE_RETIREMENT_FAILURE", "No spare resources left", _A.IGNORE),
    (158, "GPU_FATAL_TIMEOUT", "GPU fatal timeout", _A.RESET_GPU),
    (159, "ROBUST_CHANNEL_CHI_NON_DATA_ERROR", "CHI non-data error (C2C)", _A.CHECK_UVM),
    (160, "CHANNEL_RETIREMENT_EVENT", "Channel retirement event", _A.IGNORE),
    (161, "CHANNEL_RETIREMENT_FAILURE", "Channel retirement failure", _A.IGNORE),
    (162, None, "Power smoothing circuitry re-engaged", _A.NO_BUCKET),
    (163, None, "Power smoothing circuitry disengaged", _A.NO_BUCKET),
    (164, None, "Power smoothing circuitry low lifetime", _A.NO_BUCKET),
    (165, None, "Power smoothing circuitry lifetime exhausted", _A.NO_BUCKET),
    (166, None, "NVLink secure crypto error", _A.NO_BUCKET),
    (167, "PCIE_FATAL_TIMEOUT", "PCIe fatal timeout", _A.NO_BUCKET),
    (168, "REDUCED_GPU_MEMORY_CAPACITY", "Reduced GPU memory capacity", _A.NO_BUCKET),
    (169, "SEC2_HALT_ERROR", "Internal micro-controller halt (SEC2)", _A.NO_BUCKET),
    (170, None, "NVLink interrupt in confidential-computing mode", _A.NO_BUCKET),
    (171, "UNCORRECTABLE_DRAM_ERROR", "Uncorrectable DRAM error", _A.NO_BUCKET),
    (172, "UNCORRECTABLE_SRAM_ERROR", "Uncorrectable SRAM error", _A.NO_BUCKET),
)

CATALOG: MappingProxyType[int, XidInfo] = MappingProxyType(
    {xid: XidInfo(xid, action, mnemonic, short) for xid, mnemonic, short, action in _ROWS}
)
LAST_CATALOGUED_XID = max(CATALOG)

# The catalog's bucket lists (facts §1.2), derived from the table so the two cannot drift apart.
RESET_GPU_XIDS = frozenset(x for x, i in CATALOG.items() if i.action is XidAction.RESET_GPU)
RESTART_APP_XIDS = frozenset(x for x, i in CATALOG.items() if i.action is XidAction.RESTART_APP)
IGNORE_XIDS = frozenset(x for x, i in CATALOG.items() if i.action is XidAction.IGNORE)
NO_BUCKET_XIDS = frozenset(x for x, i in CATALOG.items() if i.action is XidAction.NO_BUCKET)
WORKFLOW_XIDS = frozenset(x for x, i in CATALOG.items() if i.action.name.startswith("WORKFLOW_"))
RESTART_BM_XIDS = frozenset({79})
RESTART_VM_XIDS = frozenset({151})
# RESTART_APP exceptions of one engine (copy engines, SEC2, video decode/JPEG, optical flow).
ENGINE_RESTART_APP_XIDS = frozenset(
    {39, 40, 41, 60, 68, 70, 71, 72, 75, 76, 77, 82, 83, 84, 85, 86, 88, 89, *range(96, 106), *range(126, 136), 139}
)


def lookup(xid: int) -> XidInfo:
    """What the catalog says about ``xid``; an uncatalogued number (999 included) is ``UNKNOWN``."""
    info = CATALOG.get(xid)
    if info is not None:
        return info
    if xid == XID_UNKNOWN_TO_NVML:
        return XidInfo(xid, XidAction.UNKNOWN, None, "XID unknown to NVML")
    return XidInfo(xid, XidAction.UNKNOWN, None, "not in the Xid catalog")


def immediate_action(xid: int) -> tuple[XidAction, str]:
    """The catalog's immediate action for ``xid`` and its mnemonic (or short name)."""
    info = lookup(xid)
    return info.action, info.name
