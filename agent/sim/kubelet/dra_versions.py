"""What the DRA side of the kubelet does differently from one minor release to the next (``kubelet_version`` of
``DraKubeletEmulator``), each rule read from kubernetes/kubernetes ``pkg/kubelet/cm/dra/plugin``.

Up to 1.32 (``registration.go``):
  * ``supported_versions`` are semantic versions ("1.0.0"): ``HighestSupportedVersion`` must find a 1.x, else the
    plugin is refused; every call goes to ``v1alpha4.Node`` (the only DRA gRPC API the release has). A plugin that
    lists gRPC services ("v1.DRAPlugin") is refused: "illegal version string".
  * One endpoint per driver: a registration with a higher version replaces it, an equal or lower one is refused.
  * A driver whose endpoint deregisters has its slices wiped AT ONCE (``DeRegisterPlugin``: ``go
    h.wipeResourceSlices(pluginName)``); nothing cancels that wipe, not even the driver registering again.
1.33 (``plugins_store.go``):
  * The kubelet walks ITS OWN list, ``v1beta1.DRAPlugin`` then ``v1alpha4.Node``, and takes the first the plugin
    offers; none of them: ``v1alpha4.Node`` all the same ("plugins at that time didn't advertise gRPC services"),
    so only an empty list is refused.
  * Several endpoints per driver (rolling updates); calls go to the most recent one.
  * Slices of a driver are wiped ``defaultWipingDelay`` (30 s) after its last endpoint deregistered, unless one
    registers first.
From 1.34 (``dra_plugin_manager.go``):
  * The kubelet knows ``v1.DRAPlugin`` and ``v1beta1.DRAPlugin`` and walks the PLUGIN's list: the first entry it
    knows wins; none: the plugin is refused ("none of services supported by the plugin ...").
  * Usable means connected (``monitoredPlugin.HandleConn``): calls prefer the newest connected endpoint, and the
    30 s wipe starts when the driver's last endpoint loses its connection and is cancelled when one connects.
  * The health stream (``v1alpha1.DRAResourceHealth``, opened whether or not the plugin advertised it), and
    PodResources ``dynamic_resources`` (``KubeletPodResourcesDynamicResources``, alpha and off before 1.34).
From 1.37 (``pickHealthService``): the stream is ``v1.DRAResourceHealth`` when the plugin advertises it, else
``v1alpha1.DRAResourceHealth`` when advertised (through 1.39), else none at all.

No release chooses the service again at call time: a plugin that registered a service it does not serve fails
every call with ``Unimplemented``. The emulator sends the v1alpha4 calls with the v1beta1 messages (the same fields
and numbers) on ``/v1alpha4.Node/...``, and wipes slices through ``resource.k8s.io/v1`` whatever the version.

Preparing a claim again (after a kubelet restart the checkpoint restores each claim with ``prepared`` false, so a
new pod using it calls NodePrepareResources again; or after a batch another driver failed) APPENDS the answer's
devices to those the claim holds (``claiminfo.go`` ``addDevice``): the CRI gets, and PodResources lists, each device
and CDI ID twice (kubernetes#140471). The fix (kubernetes#140274: ``resetDevices`` first) is in 1.37 and in late
patch releases of 1.34 and 1.36 (#140953, #140955): ``appends_devices`` holds up to 1.36, and
``DraKubeletEmulator(reprepare_appends=False)`` emulates a patched release.
"""

from __future__ import annotations

import re

from msgspec import Struct

from agent.sim.kubelet.common import go_quote
from agent.sim.kubelet.dra_common import (
    HEALTH_SERVICE,
    HEALTH_V1_SERVICE,
    V1_SERVICE,
    V1ALPHA4_SERVICE,
    V1BETA1_SERVICE,
    go_string_list,
)

_KUBELET_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.\d+)?")
# apimachinery util/version: versionMatchRE; ParseGeneric wants at least two numeric components
_GO_VERSION = re.compile(r"^\s*v?([0-9]+(?:\.[0-9]+)*)(.*)$")


class DraRules(Struct, frozen=True):
    """The rules of one kubelet minor release (see the module docstring)."""

    minor: int

    @property
    def services(self) -> tuple[str, ...]:
        """``servicesSupportedByKubelet`` (most recent first)."""
        if self.minor >= 34:
            return (V1_SERVICE, V1BETA1_SERVICE)
        if self.minor == 33:
            return (V1BETA1_SERVICE, V1ALPHA4_SERVICE)
        return (V1ALPHA4_SERVICE,)

    @property
    def semantic_versions(self) -> bool:
        """<= 1.32: ``supported_versions`` are semantic versions ("1.0.0"), not gRPC services."""
        return self.minor <= 32

    @property
    def one_endpoint_per_driver(self) -> bool:
        return self.minor <= 32

    @property
    def wipes_at_once(self) -> bool:
        """<= 1.32: a deregistered driver's slices go at once; later releases wait ``wipe_delay``."""
        return self.minor <= 32

    @property
    def follows_connections(self) -> bool:
        """>= 1.34: usable means connected (``monitoredPlugin.HandleConn``), and calls prefer a connected endpoint."""
        return self.minor >= 34

    @property
    def health_stream(self) -> bool:
        return self.minor >= 34

    def health_service(self, offered: list[str] | tuple[str, ...]) -> str | None:
        """The health service the kubelet streams from a plugin that offered ``offered``; None: no stream."""
        if not self.health_stream:
            return None
        if self.minor <= 36:
            return HEALTH_SERVICE  # opened for every plugin, advertised or not
        return next((s for s in (HEALTH_V1_SERVICE, HEALTH_SERVICE) if s in offered), None)

    @property
    def pod_resources_dynamic(self) -> bool:
        """``KubeletPodResourcesDynamicResources`` on by default (beta in 1.34)."""
        return self.minor >= 34

    @property
    def appends_devices(self) -> bool:
        """A claim prepared again appends the answer's devices (fixed by kubernetes#140274 in 1.37)."""
        return self.minor <= 36

    def choose(self, driver: str, endpoint: str, offered: list[str], registered: str | None) -> tuple[str, str, str]:
        """``ValidatePlugin``: (service, version, "") or ("", "", error). ``registered``: the version of the
        endpoint a <= 1.32 kubelet holds for the driver already (None if none)."""
        if self.semantic_versions:
            return _validate_versions(driver, offered, registered)
        prefix = f"invalid supported gRPC versions of DRA driver plugin {driver} at endpoint {endpoint}: "
        if not offered:
            return "", "", prefix + "empty list of supported gRPC services (aka supported versions)"
        if self.minor == 33:  # ITS OWN order decides, and v1alpha4 is the fallback
            return next((s for s in self.services if s in offered), V1ALPHA4_SERVICE), "", ""
        chosen = next((s for s in offered if s in self.services), None)  # 1.34+: the PLUGIN's order decides
        if chosen is not None:
            return chosen, "", ""
        refused = (
            f"none of services supported by the plugin ({go_string_list(offered)}) "
            f"are supported by the kubelet ({go_string_list(self.services)})"
        )
        return "", "", prefix + refused


def rules_for(kubelet_version: str) -> DraRules:
    match = _KUBELET_VERSION.fullmatch(kubelet_version.strip())
    if match is None or match.group(1) != "1":
        raise ValueError(f"kubelet version {kubelet_version!r} is not 1.<minor> (e.g. 1.36)")
    return DraRules(minor=int(match.group(2)))


def services_supported_by_kubelet(kubelet_version: str) -> tuple[str, ...]:
    """``servicesSupportedByKubelet`` of that release (see the module docstring)."""
    return rules_for(kubelet_version).services


# --------------------------------------------------------------------------------------------------
# <= 1.32: semantic versions (registration.go validateVersions, apimachinery util/version)
# --------------------------------------------------------------------------------------------------


def _parse_generic(text: str) -> tuple[tuple[int, ...], str]:
    """``version.ParseGeneric``: (components, "") or ((), the Go error)."""
    match = _GO_VERSION.match(text)
    if match is None:
        return (), f'could not parse "{text}" as version'
    components = match.group(1).split(".")
    if len(components) < 2:
        return (), f"illegal version string {go_quote(text)}"
    for part in components:
        if len(part) > 1 and part.startswith("0"):
            return (), f"illegal zero-prefixed version component {go_quote(part)} in {go_quote(text)}"
    return tuple(int(p) for p in components), ""


def _less(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)) < b + (0,) * (width - len(b))


def _show(version: tuple[int, ...]) -> str:
    return ".".join(str(c) for c in version)


def highest_supported_version(versions: list[str]) -> tuple[tuple[int, ...], str]:
    """``version.HighestSupportedVersion``: the highest 1.x of ``versions`` (walked from the last), or the error."""
    if not versions:
        return (), "empty array for supported versions"
    highest: tuple[int, ...] = ()
    last_error = ""
    for text in reversed(versions):
        parsed, error = _parse_generic(text)
        if error:
            last_error = error
            continue
        if parsed[0] > 1:
            continue
        if not highest or _less(highest, parsed):
            highest = parsed
    if not highest:
        listed = "[" + " ".join(versions) + "]"
        return (), f"could not find a highest supported version from versions ({listed}) reported: {last_error}"
    if highest[0] != 1:
        return (), f"highest supported version reported is {_show(highest)}, must be v1.x"
    return highest, ""


def _validate_versions(driver: str, offered: list[str], registered: str | None) -> tuple[str, str, str]:
    prefix = f"invalid versions of plugin {driver}: "
    if not offered:
        return "", "", prefix + "empty list for supported versions"
    highest, error = highest_supported_version(offered)
    if error:
        return "", "", prefix + f"none of the versions are supported: {error}"
    if registered is not None:
        held, _ = _parse_generic(registered)
        if not _less(held, highest):
            return (
                "",
                "",
                prefix
                + (
                    "another plugin instance is already registered with a higher supported version: "
                    f"{go_quote(_show(highest))} < {go_quote(registered)}"
                ),
            )
    return V1ALPHA4_SERVICE, _show(highest), ""
