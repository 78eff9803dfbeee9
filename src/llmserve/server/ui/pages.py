"""The built-in web pages: the playground at ``/``, the live dashboard at ``/dashboard``,
their static assets under ``/ui/`` and the JSON status endpoint they poll.

    GET /                 the playground (chat over /v1/chat/completions)
    GET /dashboard        the live dashboard (polls /v1/status)
    GET /ui/{file}        the pages' scripts, styles and icon (a fixed allowlist)
    GET /v1/status        engine, latency and per-tenant figures (server/metrics/status.py)

The pages are plain HTML, CSS and JavaScript shipped in the package (``server/ui/static/``,
package data): nothing is built at install time and nothing is fetched from elsewhere.
Every page and asset is sent with security headers: a content security policy that
allows scripts, styles and connections from this origin only (so no inline script and
no inline event handler can run, which is why all script lives in ``.js`` files),
``frame-ancestors 'none'`` and ``X-Frame-Options: DENY``, ``nosniff`` and
``Referrer-Policy: no-referrer``. API keys the pages ask for stay in the browser's
storage; the server never stores them. No torch.
"""
from __future__ import annotations

import logging
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from llmserve.contract.errors import OpenAIError
from llmserve.server.metrics.status import StatusSampler, parse_window

logger = logging.getLogger(__name__)

#: Served for every page and asset of the UI (and its status endpoint).
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"),
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
}

#: The asset suffixes the UI serves, with their media types (no guessing from the OS).
_MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}

#: Pages: URL path -> file in the static folder.
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}


def load_static_files() -> dict[str, tuple[bytes, str]]:
    """Every servable file of ``llmserve/server/static`` (name -> (bytes, media type)),
    read once at startup; names outside this allowlist are 404s."""
    folder = resources.files("llmserve.server.ui").joinpath("static")
    files: dict[str, tuple[bytes, str]] = {}
    if not folder.is_dir():
        logger.warning("the web UI's static files are missing (%s); / and /dashboard are 404",
                       folder)
        return files
    for entry in folder.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1] if "." in entry.name else ""
        media = _MEDIA_TYPES.get(suffix)
        if entry.is_file() and media is not None:
            files[entry.name] = (entry.read_bytes(), media)
    return files


def _static_response(files: dict[str, tuple[bytes, str]], name: str) -> Response:
    found = files.get(name)
    if found is None:
        raise OpenAIError(404, f"No such file: {name!r}", code="not_found")
    body, media = found
    headers = dict(SECURITY_HEADERS)
    headers["Cache-Control"] = "no-cache"
    return Response(content=body, media_type=media, headers=headers)


def install_ui_routes(app: FastAPI, sampler: StatusSampler) -> None:
    """Serve the pages, their assets and ``GET /v1/status`` (see the module docstring)."""
    files = load_static_files()

    for path, name in PAGES.items():
        app.add_api_route(path, _page_endpoint(files, name), methods=["GET"],
                          include_in_schema=False)

    async def asset(name: str) -> Response:
        if name in PAGES.values():
            raise OpenAIError(404, f"No such file: {name!r}", code="not_found")
        return _static_response(files, name)

    app.add_api_route("/ui/{name}", asset, methods=["GET"], include_in_schema=False)

    async def status(request: Request) -> Any:
        window = parse_window(request.query_params.get("window"))
        authorization = request.headers.get("authorization")
        body = await sampler.snapshot(window, authorization)
        return JSONResponse(body, headers=SECURITY_HEADERS)

    app.add_api_route("/v1/status", status, methods=["GET"], include_in_schema=False)


def _page_endpoint(files: dict[str, tuple[bytes, str]], name: str) -> Any:
    async def page() -> Response:
        return _static_response(files, name)
    page.__name__ = "ui_" + name.replace(".", "_")
    return page

