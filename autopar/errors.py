"""The one exception family the library raises, and its warning."""
from __future__ import annotations


class AutoparError(Exception):
    """Base class of every error autopar raises.

    Messages name the tensor path, its shape, the mesh and the fix, and list every problem found
    rather than only the first.
    """


class MemoryLimitError(AutoparError):
    """No plan fits the memory limit on the mesh: what `microbatches="auto"` answers with more
    microbatches."""


def collect_errors(problems: list[str], headline: str) -> None:
    """Raise one AutoparError listing every problem, if there are any."""
    if problems:
        body = "\n".join(f"  - {p}" for p in problems)
        raise AutoparError(f"{headline}\n{body}")


class AutoparWarning(UserWarning):
    """A warning from autopar (an operator replicated for lack of a rule, a checkpoint save
    left incomplete, for example)."""
