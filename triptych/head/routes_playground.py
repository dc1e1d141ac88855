"""``GET /``: the browser playground (``static/playground.html``), a static page that uses only the
public API (``/v1/models``, streamed image generations and edits, video jobs, chat) with the API key
the user types in, sent as a Bearer token.

The page itself holds no data and is served without the key (a Starlette route, outside the API's
key check), so a browser can open it and then authenticate its API calls.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import HTMLResponse

PAGE = "playground.html"


def add_playground_routes(app: FastAPI) -> None:
    html = resources.files("triptych.head").joinpath("static", PAGE).read_text(encoding="utf-8")

    async def playground(request: Request) -> HTMLResponse:
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    app.add_route("/", playground, methods=["GET"], include_in_schema=False)
