"""An owner's family of machines (issue 34): model groups only among one owner's own workers.

An owner who wants their machines to serve model groups only with each other (a "family" of
rigs, say on one LAN) gives each of them the same family code (``group_family``; the app makes
one with "New code"). The hello then carries ``group_family``: an HMAC of the code and the
queen's origin, so the queen learns which workers share a code but never the code, and the
same code reads differently at every queen. The queen groups a worker with a family only with
workers of the same family (head and members alike), and workers without one only with each
other. Pure.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

FAMILY_CONTEXT = b"apiary-group-family/1|"
MIN_CODE_CHARS = 16  # letters and digits: a code others cannot guess
CODE_BYTES = 15  # 24 base32 characters, 120 bits


def normalise_family_code(code: str) -> str:
    """A family code as it is compared: letters and digits only, lower case (what the owner
    pasted may have dashes, spaces or capitals). ``ValueError`` when too short to be secret."""
    kept = "".join(ch for ch in code.lower() if ch.isalnum())
    if len(kept) < MIN_CODE_CHARS:
        raise ValueError(f"a family code needs at least {MIN_CODE_CHARS} letters or digits "
                         f"(this one has {len(kept)}): use New code in Settings, then the same "
                         "code on each of your machines")
    return kept


def new_family_code() -> str:
    """A fresh random code, grouped for reading aloud: ``abcd-efgh-...``."""
    raw = base64.b32encode(secrets.token_bytes(CODE_BYTES)).decode().lower()
    return "-".join(raw[i:i + 4] for i in range(0, len(raw), 4))


def family_tag(code: str, origin: str) -> str:
    """What the hello says of the family at the queen of ``origin``: 32 hex digits."""
    key = normalise_family_code(code).encode()
    return hmac.new(key, FAMILY_CONTEXT + origin.encode(), hashlib.sha256).hexdigest()[:32]
