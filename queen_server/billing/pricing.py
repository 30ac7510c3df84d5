"""Prices: msat per 1,000 prompt and completion tokens, by model size class.

The size class comes from the parameter count the worker read from the GGUF metadata, never from
the model's name. A model with no known parameter count (legacy workers) is priced at the
largest class, so the queen never undercharges. Pure functions; no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from queen_server.errors import QueenError


class PricingError(QueenError):
    pass


@dataclass(frozen=True, slots=True)
class Price:
    size_class: str
    max_params: int | None  # the class holds models up to this many parameters; None: no limit
    prompt_msat_per_1k: int
    completion_msat_per_1k: int

    def cost_msat(self, prompt_tokens: int, completion_tokens: int) -> int:
        """The charge for a usage, rounded up to the next msat."""
        return (
            -(-prompt_tokens * self.prompt_msat_per_1k // 1000)
            + -(-completion_tokens * self.completion_msat_per_1k // 1000)
        )

    def max_completion_tokens(self, budget_msat: int, prompt_tokens: int) -> int:
        """The most completion tokens a budget covers after the prompt."""
        left = budget_msat - -(-prompt_tokens * self.prompt_msat_per_1k // 1000)
        if left <= 0:
            return 0
        if self.completion_msat_per_1k == 0:
            return 1 << 30
        return left * 1000 // self.completion_msat_per_1k


# Defaults: msat per 1k tokens (1 sat = 1,000 msat).
DEFAULT_PRICES: tuple[Price, ...] = (
    Price("tiny", 1_500_000_000, 100, 200),
    Price("small", 4_000_000_000, 300, 600),
    Price("medium", 9_000_000_000, 800, 1_600),
    Price("large", 15_000_000_000, 1_500, 3_000),
    Price("xl", 35_000_000_000, 3_000, 6_000),
    Price("xxl", None, 8_000, 16_000),
)


class PriceTable:
    def __init__(self, prices: Sequence[Price] = DEFAULT_PRICES) -> None:
        if not prices:
            raise PricingError("the price table is empty")
        self.prices = sorted(prices, key=lambda p: (p.max_params is None, p.max_params or 0))
        if self.prices[-1].max_params is not None:
            raise PricingError("the largest size class must have no max_params (it takes the "
                               "rest)")

    def for_parameters(self, parameter_count: int | None) -> Price:
        if parameter_count is None:
            return self.prices[-1]
        for price in self.prices:
            if price.max_params is None or parameter_count <= price.max_params:
                return price
        return self.prices[-1]

    @classmethod
    def from_file(cls, path: Path) -> PriceTable:
        """A JSON list of {size_class, max_params, prompt_msat_per_1k, completion_msat_per_1k}."""
        try:
            rows = json.loads(path.read_text())
            return cls([Price(**_row(row)) for row in rows])
        except (OSError, ValueError, TypeError) as exc:
            raise PricingError(f"cannot read the price file {path}: {exc}") from exc


def _row(row: Mapping[str, object]) -> dict[str, object]:
    allowed = {"size_class", "max_params", "prompt_msat_per_1k", "completion_msat_per_1k"}
    unknown = set(row) - allowed
    if unknown:
        raise ValueError(f"unknown price fields: {sorted(unknown)}")
    return dict(row)
