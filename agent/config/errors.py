"""The error a config that cannot be used raises: a module of its own (nothing imported), so that the agent's
side of the config checker (:mod:`agent.config.isolated`) starts the checker before anything else is loaded."""

from __future__ import annotations


class ConfigError(ValueError):
    """The config cannot be used. ``problems`` are ``path: what is wrong; how to fix it`` lines."""

    def __init__(self, origin: str, problems: list[str]) -> None:
        super().__init__(f"{origin}: " + "; ".join(problems))
        self.origin = origin
        self.problems = problems
