"""The base of every configuration section.

:mod:`router.config` composes the configuration from sections; a plugin's own section
(a policy's parameters, an index backend's settings) lives beside the plugin and
derives from :class:`Section` too, without importing the composed configuration.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A configuration section: unknown keys are refused (the error names them), and
    assigning a field validates the value."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
