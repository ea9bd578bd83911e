"""The chat page: one static HTML file, a stylesheet and a script, served by the app.

The page talks to the server's own OpenAI routes (model list, streamed chat
and completions), so it needs nothing else from the server but
``GET /ui/config``, which says whether it must ask for an API key. The page
and its files need no key themselves (they hold no data); the API calls the
page makes send the key the user typed. The files are read once, when the app
is built, and served with a Content-Security-Policy that allows this origin
only: no third-party asset can load.
"""

from __future__ import annotations

from pathlib import Path

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

STATIC_DIR = Path(__file__).resolve().parent / "static"
_ASSET_TYPES = {
    "chat.css": "text/css; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
}
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
}


def ui_routes(api_key_required: bool) -> list[Route]:
    """``GET /`` (the page), ``GET /static/{name}`` (its files) and ``GET /ui/config``."""
    page = (STATIC_DIR / "index.html").read_bytes()
    assets = {name: (STATIC_DIR / name).read_bytes() for name in _ASSET_TYPES}
    config = {"api_key_required": api_key_required}

    async def index(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=_HEADERS)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in assets:
            raise HTTPException(404)  # the app's handler gives it an OpenAI-shaped body
        return Response(assets[name], media_type=_ASSET_TYPES[name], headers=_HEADERS)

    async def ui_config(request: Request) -> Response:
        return JSONResponse(config, headers={"Cache-Control": "no-cache"})

    return [
        Route("/", index, methods=["GET"]),
        Route("/static/{name}", asset, methods=["GET"]),
        Route("/ui/config", ui_config, methods=["GET"]),
    ]
