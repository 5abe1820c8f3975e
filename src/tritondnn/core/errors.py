"""Errors tritondnn raises besides the built-in TypeError/ValueError for bad arguments."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class NotSupportedError(RuntimeError):
    """A valid problem that no engine of its family can run.

    Attributes:
        family: the primitive family (``"softmax"``, ``"conv"``...).
        problem_key: the problem's stable key.
        reasons: every engine's name mapped to the reasons it declined.
    """

    def __init__(self, family: str, problem_key: str, reasons: Mapping[str, Sequence[str]]) -> None:
        self.family = family
        self.problem_key = problem_key
        self.reasons = {name: list(why) for name, why in reasons.items()}
        lines = [f"no {family} engine supports {problem_key}:"]
        lines += [f"  {name}: {'; '.join(why)}" for name, why in self.reasons.items()]
        if not self.reasons:
            lines.append("  (no engines are registered for this family)")
        super().__init__("\n".join(lines))
