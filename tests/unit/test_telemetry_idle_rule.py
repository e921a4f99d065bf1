"""The idle rule (issue 17): a holder is idle when its own processes did no work; where NVML cannot say per
process, processes mean busy, except on a whole unshared GPU, whose utilization is then the holder's."""

from __future__ import annotations

import pytest

from agent.gpu.process_utilization import UtilizationRead
from agent.gpu.telemetry import DeviceStats, GpuStats, ProcessStat
from agent.telemetry.idle import IdleLedger
from agent.telemetry.usage import Attribution, Usage
from agent.telemetry.window import Physical, Window

GPU = Physical(("0", "GPU-a", "nvidia0", "A100", "", ""), "GPU-a", False, 81920, 81920)
MIG = Physical(("0", "GPU-a", "nvidia0", "A100", "1g.10gb", "7"), "GPU-a", True, 81920, 9728)


def window(gpu_utilization: int | None = 50, read: UtilizationRead | None = None, answered: bool = True) -> Window:
    stats = {"GPU-a": GpuStats("GPU-a", None, DeviceStats("GPU-a", 1, 1, gpu_utilization, (ProcessStat(1, 1),)))}
    return Window(
        {"GPU-a": GPU}, stats if answered else {}, {"GPU-a": read} if read else {}, (), Attribution({}, {}), 10.0,
        100.0, 5.0, "h",
    )  # fmt: skip


def busy(load: list[float] | None, processes: int = 1) -> Usage:
    return Usage(processes, 0, load)


@pytest.mark.parametrize(
    ("usage", "where", "replicas", "gpu_utilization", "idle"),
    [
        (None, GPU, 4, 90, True),  # no process of its own: idle, however busy the GPU
        (busy([4.9, 0, 0, 0]), GPU, 4, 90, True),  # under the threshold
        (busy([0, 0, 6, 0]), GPU, 4, 0, False),  # the encoder is work too
        (busy(None), MIG, 1, None, False),  # a MIG device: processes NVML cannot measure are busy
        (busy(None), GPU, 4, 0, False),  # a shared GPU without per-process numbers: not guessed from the GPU's
        (busy(None), GPU, 1, 2, True),  # the whole unshared GPU: its utilization is the holder's
        (busy(None), GPU, 1, 50, False),
        (busy(None), GPU, 1, None, False),
        (busy(None, processes=0), GPU, 4, 90, True),  # only exited processes: nothing runs now
    ],
)
def test_the_idle_rule(usage: Usage | None, where: Physical, replicas: int, gpu_utilization: int | None, idle: bool):
    assert window(gpu_utilization).is_idle(usage, where, replicas) is idle


def test_a_gpu_nvml_did_not_answer_for_is_never_idle() -> None:
    assert window(answered=False).is_idle(None, GPU, 1) is False


def test_no_process_reads_zero_only_where_nvml_measures_per_process() -> None:
    assert window().zero_load(GPU) == (0.0, 0.0, 0.0, 0.0)
    assert window(read=UtilizationRead(error="NOT_SUPPORTED")).zero_load(GPU) is None
    assert window().zero_load(MIG) is None


def test_the_ledger_counts_streaks_and_gpu_seconds_and_forgets_released_devices() -> None:
    ledger = IdleLedger()
    assert ledger.credit(("a",), "ml", True, 10.0, 0.25, now=100.0) == (10.0, 10.0)
    assert ledger.credit(("a",), "ml", True, 10.0, 0.25, now=110.0) == (20.0, 20.0)
    assert ledger.credit(("a",), "ml", False, 10.0, 0.25, now=120.0) == (20.0, 0.0)  # busy: the streak ends
    assert ledger.credit(("b",), "web", True, 4.0, 1.0, now=120.0) == (4.0, 4.0)
    assert ledger.namespace_seconds == {"ml": 5.0, "web": 4.0} and ledger.node_seconds == 9.0
    ledger.keep([("b",)])
    assert ledger.credit(("a",), "ml", False, 1.0, 0.25, now=121.0) == (0.0, 0.0)  # released: a new series
    assert ledger.namespace_seconds["ml"] == 5.0, "the namespace's counter never goes down"
