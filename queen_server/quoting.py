"""A model's price and why, from the three rooms that know part of it: the operator's price table
(``billing``), the queen's own readings of hub files (``catalog``) and what the holders of each
model say of its file (``swarm.claims``). The rules are ``billing.quotes``' (pure); this joins
them, and caches each held model's quote until its holders' claims or the readings change, so
a quote costs O(1) per request and per routing score (a name no worker holds here is quoted
directly: no claims to read, nothing cached for it).
"""

from __future__ import annotations

from queen_server.billing.pricing import Price, PriceTable
from queen_server.billing.quotes import Quote, file_bound, quote, reason
from queen_server.catalog import ModelCatalog
from queen_server.swarm.claims import FileClaims
from shared_schema import ModelPrice, WorkerModelPrice

MAX_CACHED = 10_000  # quotes kept (names held here); past it the cache starts afresh


class Pricer:
    def __init__(self, table: PriceTable, catalog: ModelCatalog, claims: FileClaims) -> None:
        self.table = table
        self.catalog = catalog
        self.claims = claims
        self._cache: dict[str, tuple[int, int, Quote]] = {}

    def quote(self, name: str) -> Quote:
        """``name``'s price and its basis, as things stand (starts no hub reading)."""
        stamp = self.claims.stamp(name)
        if not stamp:
            return quote(self.table, name, self.catalog.parameter_count(name), None)
        version = self.catalog.version
        cached = self._cache.get(name)
        if cached is not None and cached[0] == stamp and cached[1] == version:
            return cached[2]
        bound = file_bound(self.claims.of(name), self._read)
        result = quote(self.table, name, self.catalog.parameter_count(name), bound)
        if len(self._cache) >= MAX_CACHED:
            self._cache.clear()
        self._cache[name] = (stamp, version, result)
        return result

    def price(self, name: str) -> Price:
        return self.quote(name).price

    def model_price(self, name: str) -> ModelPrice:
        """The price as the wire shows it (``/v1/models``, ``/stats``, a worker's earnings):
        the class, the rates, the basis and the reason in words."""
        quoted = self.quote(name)
        return ModelPrice(size_class=quoted.price.size_class,
                          prompt_msat_per_1k=quoted.price.prompt_msat_per_1k,
                          completion_msat_per_1k=quoted.price.completion_msat_per_1k,
                          basis=quoted.basis, reason=reason(self.table, quoted))

    def worker_price(self, name: str, worker_share: float, pays: bool) -> WorkerModelPrice:
        """One of a worker's models as this queen prices it, with what the worker earns of
        it (``/worker/earnings``)."""
        price = self.model_price(name)
        return WorkerModelPrice(name=name, price=price, earn_msat_per_1k_tokens=(
            worker_earn_msat_per_1k(price.completion_msat_per_1k, worker_share, pays)))

    def _read(self, sha256: str) -> tuple[str, int] | None:
        facts = self.catalog.same_file(sha256)
        return (facts.name, facts.parameter_count) if facts is not None else None


def worker_earn_msat_per_1k(completion_msat_per_1k: int, worker_share: float,
                            pays: bool) -> int:
    """What a worker earns per 1,000 completion tokens of a model priced at
    ``completion_msat_per_1k`` (0 on a queen that does not pay)."""
    return int(completion_msat_per_1k * worker_share) if pays else 0
