"""The suite's figures: trials run, faults injected, records checked, losses found.

Each fault test adds its counts here; tests/conftest.py prints the table at the end of the pytest
run, so the figures are visible in `pytest -q` output (under pytest-xdist each worker hands its rows
to the controller, which merges them).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Figures:
    trials: int = 0
    faults: int = 0
    records: int = 0
    losses: int = 0


LEDGER: dict[str, Figures] = {}


def add(target: str, *, trials: int = 0, faults: int = 0, records: int = 0, losses: int = 0) -> None:
    row = LEDGER.setdefault(target, Figures())
    row.trials += trials
    row.faults += faults
    row.records += records
    row.losses += losses


def export() -> dict[str, dict[str, int]]:
    """The rows as plain data (what an xdist worker sends to the controller)."""
    return {name: vars(row).copy() for name, row in LEDGER.items()}


def merge(rows: dict[str, dict[str, int]]) -> None:
    for name, counts in rows.items():
        add(name, **counts)


def table() -> list[str]:
    if not LEDGER:
        return []
    width = max(len("target"), *(len(name) for name in LEDGER))
    head = f"{'target':<{width}}  {'trials':>6}  {'faults':>6}  {'records':>8}  {'losses':>6}"
    lines = [head, "-" * len(head)]
    total = Figures()
    for name, row in LEDGER.items():
        lines.append(f"{name:<{width}}  {row.trials:>6}  {row.faults:>6}  {row.records:>8}  {row.losses:>6}")
        total.trials += row.trials
        total.faults += row.faults
        total.records += row.records
        total.losses += row.losses
    lines.append("-" * len(head))
    lines.append(f"{'total':<{width}}  {total.trials:>6}  {total.faults:>6}  {total.records:>8}  {total.losses:>6}")
    return lines
