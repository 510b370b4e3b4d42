"""The playground: a static page, shipped in the package, that turns the dial in a browser.

    GET /playground          the page (server/gateway/static/; no build step, no CDN: works offline)
    GET /playground/assets/  its script and stylesheet
    GET /v1/dial             the served pair and its dial (tiers, head, provenance support): public
                             API, behind the API key like the rest of /v1

The page talks to the server only through the public HTTP API (`/v1/dial`, `/v1/chat/completions`
with `dialspec_trace`), so what it shows is what any client gets. Its Content-Security-Policy
allows nothing but this origin: a page that tried to load from elsewhere would break in tests.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from server.engine.protocol import Engine
from server.gateway.responses import DialInfo
from server.gateway.settings import GatewaySettings

STATIC_DIR = Path(__file__).resolve().parent / "static"
# Scripts, styles, images and connections from this origin only; no inline script, no framing.
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def dial_info(engine: Engine, settings: GatewaySettings) -> dict:
    info, config = engine.info, settings.dial_config()
    tiers = sorted(config.tiers.items(), key=lambda kv: kv[1])
    return {
        "model": info.model,
        "backend": info.backend,
        "num_draft": info.num_draft,
        "max_context": info.max_context,
        "tiers": [{"name": name, "quality": q} for name, q in tiers],
        "default_quality": config.default_quality,
        "has_head": info.has_head,
        "token_provenance": info.token_provenance,
    }


def install(app: FastAPI, engine: Engine, settings: GatewaySettings) -> None:
    """Add the page, its assets and `/v1/dial` to `app`."""
    page = (STATIC_DIR / "index.html").read_text(encoding="utf-8")

    @app.get("/playground", response_class=HTMLResponse, include_in_schema=False)
    async def playground():
        return HTMLResponse(page, headers=_HEADERS)

    app.mount("/playground/assets", StaticFiles(directory=STATIC_DIR), name="playground-assets")

    @app.get("/v1/dial", response_model=DialInfo)
    async def dial():
        """The served pair and its dial: tiers (name -> quality), whether `quality: "auto"` (a
        learned head) and `dialspec_trace` (per-token provenance) are served."""
        return dial_info(engine, settings)
