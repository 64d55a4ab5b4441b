"""The read-only web page of the controller and of the agent: ``GET /ui``.

One static page (``static/index.html``, ``ui.js``, ``ui.css``, shipped in the package) that
the browser fills in by calling the daemon's own JSON API — the controller's ``/v1/jobs`` and
``/v1/jobs/{job}``, the agent's ``/status`` — with the same bearer token as every other client.
So the page adds no way in and no second authentication:

* the page and its assets hold no data and are served without a token; every piece of data
  comes from the token-protected API, ``Authorization: Bearer`` sent by the script;
* the token is typed into the page and kept in the tab's ``sessionStorage`` (gone when the
  tab closes), never put in a URL, a cookie or a query string (``form-action 'none'``: even
  with scripts off, the form cannot send it anywhere);
* everything shown is set as text (``textContent``), never parsed as HTML;
* every answer under ``/ui`` carries a strict Content-Security-Policy (:data:`CSP`: scripts,
  styles and requests from the daemon itself only, no inline code, no frames) and
  ``nosniff``, ``no-referrer``, ``DENY`` framing, ``no-store``.

Why a static page over the existing API rather than server-rendered HTML: a browser cannot
send a bearer token when it navigates, so server-rendered data would need a second way to
authenticate (a cookie, a token in the URL); with the script, the API and its checks stay the
only door. No framework: about 300 lines of plain JavaScript.

:func:`add_routes` registers the page on an aiohttp application; :func:`is_ui_path` tells an
authenticating middleware which paths are the page's (open, like ``/healthz``).
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Literal

from aiohttp import web

#: where the page is served; its assets live under ``/ui/static/``
UI_PATH = "/ui"
STATIC_PREFIX = "/ui/static/"

#: the page's Content-Security-Policy: nothing but the daemon's own script, style and API
CSP = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "base-uri 'none'",
        "form-action 'none'",
        "frame-ancestors 'none'",
    )
)

HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cache-Control": "no-store",
}

Page = Literal["controller", "agent"]

_ASSETS = {
    "ui.js": "text/javascript",
    "ui.css": "text/css",
    "favicon.svg": "image/svg+xml",
}


@cache
def _asset(name: str) -> bytes:
    return (resources.files(__package__) / "static" / name).read_bytes()


def page_html(page: Page) -> bytes:
    """The page for ``page`` (which API its script calls: a fixed word, never request data)."""
    return _asset("index.html").replace(b"__PAGE__", page.encode())


def is_ui_path(path: str) -> bool:
    """Whether ``path`` is the page or one of its assets (served without a token)."""
    return path in (UI_PATH, UI_PATH + "/") or path.startswith(STATIC_PREFIX)


def add_routes(app: web.Application, page: Page) -> None:
    """Serve the page (for ``page``'s API) at ``/ui`` on ``app``."""

    async def index(request: web.Request) -> web.Response:
        return web.Response(
            body=page_html(page), content_type="text/html", charset="utf-8", headers=HEADERS
        )

    async def asset(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        kind = _ASSETS.get(name)
        if kind is None:
            return web.Response(status=404, text="no such file", headers=HEADERS)
        return web.Response(body=_asset(name), content_type=kind, charset="utf-8", headers=HEADERS)

    app.router.add_get(UI_PATH, index)
    app.router.add_get(UI_PATH + "/", index)
    app.router.add_get(STATIC_PREFIX + "{name}", asset)
