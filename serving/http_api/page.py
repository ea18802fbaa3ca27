"""The page at `/` (type, pick a voice, hear it stream) and the API docs at `/docs`, rendered in the browser
from `/openapi.json`. Both are files of this package (serving/http_api/static/), read once at import: a request only
picks one of them by name, it never names a path to open, and the Content-Security-Policy lets the page reach
nothing but this server."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from serving.errors import ApiError

_STATIC = Path(__file__).resolve().parent / "static"
_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
FILES = {p.name: (p.read_bytes(), _TYPES[p.suffix]) for p in sorted(_STATIC.iterdir()) if p.suffix in _TYPES}
# same origin only (no CDN, no fonts, no analytics); blob: for the WAV the page made itself (download link)
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self' blob:; img-src 'self'; "
       "media-src 'self' blob:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def _file(name: str) -> web.Response:
    try:
        body, content_type = FILES[name]
    except KeyError:
        raise ApiError(404, "not_found", f"no file {name!r} here; the page's files are {sorted(FILES)}") from None
    return web.Response(body=body, content_type=content_type, charset="utf-8",
                        headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache",
                                 "X-Content-Type-Options": "nosniff"})


async def index(request: web.Request) -> web.Response:
    return _file("index.html")


async def docs(request: web.Request) -> web.Response:
    return _file("docs.html")


async def static(request: web.Request) -> web.Response:
    return _file(request.match_info["name"])


def setup(app: web.Application) -> None:
    app.router.add_get("/", index)
    app.router.add_get("/docs", docs)
    app.router.add_get("/static/{name}", static)
