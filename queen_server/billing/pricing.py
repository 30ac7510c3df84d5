"""Prices: msat per 1,000 prompt and completion tokens, by model size class.

The size class comes from the parameter count the queen itself read from the model file's GGUF
header on the hub (``queen_server.catalog``), never from a worker's word or the model's name. The
operator's price file may name a class for a model outright (for models the queen cannot read,
such as files imported on a worker); a model with neither is priced at the operator's class for
unverified models, by default the largest, so the queen never undercharges. Pure; no I/O.
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
    """The size classes, smallest first, and the operator's class for named models."""

    def __init__(self, prices: Sequence[Price] = DEFAULT_PRICES,
                 models: Mapping[str, str] | None = None,
                 unverified_class: str | None = None) -> None:
        if not prices:
            raise PricingError("the price table is empty")
        self.prices = sorted(prices, key=lambda p: (p.max_params is None, p.max_params or 0))
        if self.prices[-1].max_params is not None:
            raise PricingError("the largest size class must have no max_params (it takes the "
                               "rest)")
        self._by_class = {price.size_class: price for price in self.prices}
        if len(self._by_class) != len(self.prices):
            raise PricingError("two size classes have the same name")
        self.models = {name: self.named(size_class) for name, size_class in (models or {}).items()}
        self.unverified = self.named(unverified_class) if unverified_class else self.prices[-1]

    def named(self, size_class: str) -> Price:
        try:
            return self._by_class[size_class]
        except KeyError:
            raise PricingError(f"no size class named {size_class!r} (the classes are "
                               f"{', '.join(self._by_class)})") from None

    def for_parameters(self, parameter_count: int | None) -> Price:
        """The class of a model of ``parameter_count`` parameters (None: the largest)."""
        if parameter_count is None:
            return self.prices[-1]
        for price in self.prices:
            if price.max_params is None or parameter_count <= price.max_params:
                return price
        return self.prices[-1]

    def for_model(self, name: str, parameter_count: int | None) -> Price:
        """A model's price: the operator's class for it if the price file names one, else the
        class of the parameter count the queen read itself (None: it could not read one), else
        the class for unverified models."""
        named = self.models.get(name)
        if named is not None:
            return named
        if parameter_count is None:
            return self.unverified
        return self.for_parameters(parameter_count)

    @classmethod
    def from_file(cls, path: Path, unverified_class: str | None = None) -> PriceTable:
        """A JSON list of {size_class, max_params, prompt_msat_per_1k, completion_msat_per_1k},
        or an object {"classes": [that list], "models": {model name: size class}}."""
        try:
            data = json.loads(path.read_text())
            rows, models = (data, {}) if isinstance(data, list) else _table(data)
            return cls([Price(**_row(row)) for row in rows], models, unverified_class)
        except PricingError as exc:
            raise PricingError(f"the price file {path}: {exc}") from exc
        except (OSError, ValueError, TypeError) as exc:
            raise PricingError(f"cannot read the price file {path}: {exc}") from exc


def _table(data: object) -> tuple[list[Mapping[str, object]], dict[str, str]]:
    if not isinstance(data, dict):
        raise ValueError("expected a list of classes or an object with 'classes'")
    unknown = set(data) - {"classes", "models"}
    if unknown:
        raise ValueError(f"unknown fields: {sorted(unknown)}")
    models = data.get("models", {})
    if not isinstance(models, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in models.items()):
        raise ValueError("'models' must map model names to size class names")
    rows = data.get("classes", [_as_row(p) for p in DEFAULT_PRICES])
    if not isinstance(rows, list):
        raise ValueError("'classes' must be a list")
    return rows, models


def _as_row(price: Price) -> dict[str, object]:
    return {"size_class": price.size_class, "max_params": price.max_params,
            "prompt_msat_per_1k": price.prompt_msat_per_1k,
            "completion_msat_per_1k": price.completion_msat_per_1k}


def _row(row: Mapping[str, object]) -> dict[str, object]:
    if not isinstance(row, Mapping):
        raise ValueError("each class must be an object")
    allowed = {"size_class", "max_params", "prompt_msat_per_1k", "completion_msat_per_1k"}
    unknown = set(row) - allowed
    if unknown:
        raise ValueError(f"unknown price fields: {sorted(unknown)}")
    return dict(row)
