"""Which MIG layout this node wants, per GPU: the layout file (``--mig-config`` or the config's ``migLayout``), the
layout named by flag, node label or config, and only on the GPUs a static layout may touch.

A static layout leaves alone every GPU DRA serves, is taking over, or a claim holds: its MIG devices are claims'
devices, made per claim with ``dra.dynamicMig`` or laid out while the device plugin served it. Each GPU left out is
said once in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from msgspec import Struct, field

from agent.core.inventory import Gpu

if TYPE_CHECKING:
    from agent.config.model import MigLayoutSection
    from agent.core.mig_layout import DesiredLayout

log = logging.getLogger(__name__)


class LayoutSelection(Struct):
    """Where the layouts come from (``--mig-config`` / ``--mig-config-name``); what was said of GPUs left alone."""

    mig_config: Path | None = None
    mig_config_name: str | None = None
    _said: set[str] = field(default_factory=set)

    def configured(self, section: MigLayoutSection | None) -> bool:
        """A MIG layout is configured (--mig-config, or the config's migLayout.layouts), selected or not."""
        return self.mig_config is not None or (section is not None and section.layouts is not None)

    def desired(
        self, section: MigLayoutSection | None, gpus: tuple[Gpu, ...], label: str | None
    ) -> dict[int, DesiredLayout] | None:
        """The layout per GPU index, named by flag, the node label ``nvidia.com/mig.config`` (``label``) or the
        config; None when none is configured or selected (MIG is then left as it is, as NVIDIA's
        mig-manager waits). ``LayoutError`` (a bad file, an unknown name) names what is wrong."""
        if not self.configured(section):
            return None  # no layout configured: the layout-file parser (pydantic, yaml) is not even imported
        from agent.core.mig_layout import LayoutError
        from agent.mig.layout_file import LayoutFileError, layouts_for_node, parse_layout_file, read_layout_file

        try:
            if self.mig_config is not None:
                origin, data = str(self.mig_config), read_layout_file(self.mig_config)
            else:
                assert section is not None
                origin, data = "migLayout.layouts", section.layouts
            layout_file = parse_layout_file(data, origin)
            name = self.mig_config_name or label or (section.config if section else None)
            if name is None and len(layout_file.mig_configs) == 1:
                name = next(iter(layout_file.mig_configs))
            if name is None:
                return None
            return layouts_for_node(layout_file, name, gpus)
        except LayoutFileError as error:  # one error type for the caller, which then needs no import
            raise LayoutError(str(error), error.problems) from error

    def leaving_alone(
        self, layouts: Mapping[int, DesiredLayout], dra: Collection[int], dynamic: Collection[int]
    ) -> dict[int, DesiredLayout]:
        """``layouts`` without the GPUs DRA serves, takes or a claim holds (``dra``) and dynamic MIG's (``dynamic``)."""
        owned = {*dra, *dynamic}
        for skipped, why in (
            (set(dynamic), "dra.dynamicMig makes their MIG devices per claim"),
            (owned - set(dynamic), "DRA serves them (give a GPU back to the device plugin to change its layout)"),
        ):
            if skipped & layouts.keys():
                gpus = ", ".join(map(str, sorted(skipped & layouts.keys())))
                said = f"the MIG layout leaves GPUs {gpus} alone: {why}"
                if said not in self._said:
                    self._said.add(said)
                    log.warning("%s", said)
        return {index: layout for index, layout in layouts.items() if index not in owned}
