"""The one exception type a bad configuration produces.

A config error must tell the user where to look (file and line, or the environment variable),
which key is wrong and what would be accepted, so it carries those as attributes and renders
them as ``kvtier.yaml:4: tiers.cpu.capacity: must be positive, got '-1GiB' (allowed: ...)``.
It subclasses ``ValueError`` so callers that only know "bad value" still catch it.
"""

from __future__ import annotations


class ConfigError(ValueError):
    def __init__(
        self,
        problem: str,
        *,
        file: str | None = None,
        line: int | None = None,
        key: str | None = None,
        allowed: str | None = None,
    ) -> None:
        self.file = file
        self.line = line  # 1-based, None when unknown (dict or environment input)
        self.key = key  # dotted config key, or the environment variable's name
        self.problem = problem
        self.allowed = allowed
        super().__init__(str(self))

    def __str__(self) -> str:
        where = self.file or ""
        if self.line is not None:
            where = f"{where}:{self.line}"
        parts = [p for p in (where, self.key) if p]
        text = ": ".join([*parts, self.problem])
        if self.allowed:
            text += f" (allowed: {self.allowed})"
        return text

    def __reduce__(self):  # keep the attributes across pickling (multiprocessing, xdist)
        return (_rebuild, (self.problem, self.file, self.line, self.key, self.allowed))


def _rebuild(problem, file, line, key, allowed) -> ConfigError:
    return ConfigError(problem, file=file, line=line, key=key, allowed=allowed)
