"""The browser chat page: `GET /` serves chat.html, one file of HTML, CSS and vanilla JS.

No build step and no assets to route: the page talks to /v1/chat/completions of the same
server (relative URLs, so it works behind a Serve route prefix too). The route needs no API
key (app/api/middleware.py lists "/" as open); the page sends the key its user types.
"""
from __future__ import annotations

import functools
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

PAGE = Path(__file__).with_name("chat.html")

router = APIRouter(tags=["Web"])


@functools.cache
def page_html() -> str:
    return PAGE.read_text(encoding="utf-8")


@router.get("/", response_class=HTMLResponse, include_in_schema=False)
async def chat_page() -> HTMLResponse:
    return HTMLResponse(page_html())
