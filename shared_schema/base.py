"""The base model of every wire type.

Sending is strict: building a model rejects unknown fields and values that do not fit a field's
type (pydantic's lax conversions, such as "3" for an int, still apply). Receiving is lenient
about additions: decoders call ``model_validate_json(..., extra="ignore")`` so that a newer peer's
extra fields never break an older one.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class WireModel(BaseModel):
    # JSON has no NaN or infinity: a float that cannot be sent back is refused on the way in
    # (a ping with ``"ts": NaN`` would otherwise be answered with an undecodable ``"ts": null``).
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)


class LenientModel(BaseModel):
    """A wire type that keeps fields it does not know (OpenAI payloads we relay untouched)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
