"""Why a model costs what it costs: the queen's price for a name, with its basis and the reason
in words, for the developer (``/v1/models``, ``/stats``, the pages) and for the worker that
serves it (``/worker/earnings``). Pure; no I/O.

A model's class comes, first to last, from:

* ``operator``: the operator's price file names the model;
* ``verified``: the queen read the model's file on the hub itself and counted its parameters;
* ``same_file``: its holders say they hold a file (by sha256) the queen read on the hub under
  another name (a SmolLM2 file imported under a local name, say);
* ``file_size``: the largest file its holders report, at the fewest bits a GGUF file stores a
  weight in (``MIN_BITS_PER_WEIGHT``), so an honest file is never undercharged;
* ``unverified``: none of these; the operator's class for unverified models (by default the
  largest, so the queen never undercharges).

The last three are the holders' word, so they only ever *lower* the price from the unverified
class, never raise it past it (a claim that would is ignored), and the largest claim of any
holder counts, so no holder can lower another's pay (``file_bound``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from queen_server.billing.pricing import Price, PriceTable

OPERATOR, VERIFIED, SAME_FILE, FILE_SIZE, UNVERIFIED = (
    "operator", "verified", "same_file", "file_size", "unverified")
BASES = (OPERATOR, VERIFIED, SAME_FILE, FILE_SIZE, UNVERIFIED)
# IQ1_S, llama.cpp's smallest type, stores a weight in 1.5625 bits: a file of n bytes holds at
# most n * 8 / 1.5 parameters (a little more than any real file: never an undercharge).
MIN_BITS_PER_WEIGHT = 1.5


def most_parameters(size_bytes: int) -> int:
    """The most parameters a GGUF file of ``size_bytes`` can hold."""
    return int(size_bytes * 8 // MIN_BITS_PER_WEIGHT)


@dataclass(frozen=True, slots=True)
class FileBound:
    """The most parameters a model's holders' files can have, and what says so: the queen's
    own reading of the same file (``read_as``, the hub name it was read under), else the size
    of the largest file a holder reports (``size_bytes``)."""

    parameter_count: int
    read_as: str | None = None
    size_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Quote:
    """A model's price and why (see the module docstring for ``basis``)."""

    price: Price
    basis: str
    parameter_count: int | None = None  # as read (verified, same_file) or at most (file_size)
    read_as: str | None = None  # same_file: the hub name the queen read the file under
    size_bytes: int | None = None  # file_size: the largest file its holders report

    @property
    def verified(self) -> bool:
        return self.basis == VERIFIED


def file_bound(claims: Iterable[tuple[str | None, int]],
               read: Callable[[str], tuple[str, int] | None]) -> FileBound | None:
    """The bound of a model's holders' files from their claims ``(sha256, size_bytes)``: for
    each, the queen's reading of that sha256 (``read`` gives the hub name and the parameter
    count, or None), else the most its size allows. The largest of them, or None when any
    holder says nothing the queen can use (no known sha256 and no size), or there is none."""
    best: FileBound | None = None
    for sha256, size_bytes in claims:
        reading = read(sha256) if sha256 else None
        if reading is not None:
            bound = FileBound(reading[1], read_as=reading[0])
        elif size_bytes > 0:
            bound = FileBound(most_parameters(size_bytes), size_bytes=size_bytes)
        else:
            return None
        if best is None or bound.parameter_count > best.parameter_count:
            best = bound
    return best


def quote(table: PriceTable, name: str, parameter_count: int | None,
          bound: FileBound | None) -> Quote:
    """``name``'s price: the operator's class for it, else the class of the parameter count
    the queen read (``parameter_count``), else the class of its holders' ``bound`` when that
    is below the class for unverified models, else that class."""
    named = table.models.get(name)
    if named is not None:
        return Quote(named, OPERATOR)
    if parameter_count is not None:
        return Quote(table.for_parameters(parameter_count), VERIFIED, parameter_count)
    if bound is not None:
        price = table.for_parameters(bound.parameter_count)
        if rank(table, price) < rank(table, table.unverified):
            if bound.read_as is not None:
                return Quote(price, SAME_FILE, bound.parameter_count, read_as=bound.read_as)
            return Quote(price, FILE_SIZE, bound.parameter_count, size_bytes=bound.size_bytes)
    return Quote(table.unverified, UNVERIFIED)


def rank(table: PriceTable, price: Price) -> int:
    """A class's place among the table's, smallest first."""
    return next(i for i, p in enumerate(table.prices) if p.size_class == price.size_class)


def reason(table: PriceTable, quoted: Quote) -> str:
    """Why ``quoted`` is this price, in one sentence a developer reads before paying."""
    cls = quoted.price.size_class
    params = _params(quoted.parameter_count)
    if quoted.basis == OPERATOR:
        return f"operator: this queen's operator prices this model as the {cls} class"
    if quoted.basis == VERIFIED:
        return (f"verified: the queen read this model's file on the hub ({params} parameters), "
                f"so it is priced as the {cls} class")
    if quoted.basis == SAME_FILE:
        return (f"same file: the queen read this very file (by its sha256) on the hub as "
                f"{quoted.read_as} ({params} parameters), so it is priced as the {cls} class")
    if quoted.basis == FILE_SIZE:
        return (f"unverified: the queen could not read this model's file on the hub; its "
                f"workers report a file of {_size(quoted.size_bytes)}, which holds at most "
                f"{params} parameters, so it is priced as the {cls} class")
    if quoted.price.size_class == table.prices[-1].size_class:
        return ("unverified: the queen could not read this model's file on the hub, so it is "
                f"priced as the largest class ({cls})")
    return ("unverified: the queen could not read this model's file on the hub, so it is "
            f"priced as the {cls} class, this queen's class for unverified models")


def _params(count: int | None) -> str:
    if count is None:
        return "?"
    if count >= 1_000_000_000:
        return f"{count / 1e9:.2f}".rstrip("0").rstrip(".") + "B"
    if count >= 1_000_000:
        return f"{round(count / 1e6):,}M"
    return f"{count:,}"


def _size(size_bytes: int | None) -> str:
    """Bytes in binary units, as the worker's app shows its files (``98 MB`` is MiB)."""
    value = float(size_bytes or 0)
    for unit in ("bytes", "KB", "MB"):
        if value < 1024:
            return f"{value:.0f} {unit}"
        value /= 1024
    return f"{value:.1f} GB"
