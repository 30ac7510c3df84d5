"""The queen's web pages: a public landing page for developers and the admin pages.

Server-rendered with Jinja2 from the same data the pages then poll (``/stats``, ``/admin/api/*``:
both come from ``queen_server.reports``), so the first paint and every refresh show the same
numbers. ``router`` carries the pages and the static files (``/static``: uPlot, ``app.js``,
``app.css``); ``app.include_router(router)`` is all an app needs, with ``admin_session_valid``
handed to the admin JSON routes so that the pages' session opens them too.
"""

from queen_server.web.pages import STATIC_DIR, router
from queen_server.web.session import SESSION_COOKIE, admin_authorized, admin_session_valid

__all__ = ["SESSION_COOKIE", "STATIC_DIR", "admin_authorized", "admin_session_valid", "router"]
