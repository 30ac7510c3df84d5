"""A guard against a reference-counting bug in PySide6 6.12 on CPython before 3.12.

PySide6 6.12's stable-ABI wheels (``cp310-abi3``) return ``None`` from every void method, and
``True`` from every signal emit, without taking a new reference. On Python 3.12+ those objects
are immortal and nothing happens. On 3.11 each call lowers their reference count by one, and
after some thousands of calls (minutes of a busy window) the interpreter aborts with "Fatal
Python error: none_dealloc" or "bool_dealloc".

``protect_singletons()`` raises the reference counts of ``None``, ``True`` and ``False`` by
2**40 once, which makes them as good as immortal, as 3.12 does. It does nothing on 3.12+ and on
interpreters other than CPython. Remove it when the project requires Python 3.12 or a PySide6
without the bug.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys

log = logging.getLogger(__name__)

_BOOST = 1 << 40


def needs_protection() -> bool:
    return platform.python_implementation() == "CPython" and sys.version_info < (3, 12)


def protect_singletons() -> bool:
    """Make ``None``, ``True`` and ``False`` effectively immortal (once). Returns whether it
    changed anything."""
    if not needs_protection():
        return False
    changed = False
    for singleton in (None, True, False):
        refcount = ctypes.c_ssize_t.from_address(id(singleton))  # ob_refcnt comes first
        if refcount.value < _BOOST // 2:  # not raised yet
            refcount.value += _BOOST
            changed = True
    if not changed:
        return False
    log.debug("PySide6 refcount guard: None, True and False made immortal on Python %s",
              platform.python_version())
    return True
