"""The queen's web pages: a public landing page for developers and the admin pages.

Server-rendered with Jinja2 from the same JSON the pages then poll (``/stats``, ``/admin/api/*``),
so the first paint and every refresh show the same numbers. ``router`` carries the pages and the
static files (``/static``: uPlot, ``app.js``, ``app.css``); ``app.include_router(router)`` is all
an app needs. ``admin_authorized(request)`` is the admin check the JSON endpoints share: the
session cookie set by ``/admin/login`` or ``Authorization: Bearer <admin token>``.
"""

from queen_server.web.pages import (
    SESSION_COOKIE,
    STATIC_DIR,
    admin_authorized,
    admin_session_valid,
    router,
)

__all__ = ["SESSION_COOKIE", "STATIC_DIR", "admin_authorized", "admin_session_valid", "router"]
