"""Run-time LoRA routes: list, load and unload the adapters a model serves (``docs/lora.md``).

``GET /v1/loras`` lists each served model's adapters (``source``: ``flag`` for ``serve --lora``,
``api`` for loaded here) with the denoisers holding each in memory; ``POST /v1/loras``
``{"name", "path", "model"?}`` serves one more from under ``serve --lora-root`` (checked against the
model's shapes as ``--lora`` adapters are; a 400 names the field, the value and the rule);
``DELETE /v1/loras/{name}`` stops serving a run-time one: new requests naming it get a 400, running
ones finish (the denoisers keep it while in use and evict it later). Behind the API key like every
``/v1`` route. The catalog is the head's; a denoiser learns a run-time adapter's file from the
request that names it (``GenerationParams.lora_paths``) and loads it on a miss.
"""

from __future__ import annotations

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from triptych.core.errors import shown
from triptych.head.state import Head


class LoraLoad(BaseModel):
    name: str = Field(min_length=1, max_length=64, description="the name requests will give in `lora`")
    path: str = Field(min_length=1, max_length=4096, description="adapter folder or file under --lora-root")
    model: str | None = Field(None, description="served model (default: the first)")


def add_lora_routes(app: FastAPI, head: Head) -> None:
    def listing() -> dict:
        return {"object": "list", "data": [dict(c, model=m.name) for m in head.models for c in m.card().loras]}

    @app.get("/v1/loras")
    async def list_loras():
        return listing()

    @app.post("/v1/loras")
    async def load_lora(body: LoraLoad):
        served = head.models.pick(body.model, "image")
        info = served.lora.add(body.name, body.path)
        return {"object": "lora", "name": info.name, "model": served.name, "rank": info.rank, "bytes": info.nbytes}

    @app.delete("/v1/loras/{name}")
    async def unload_lora(name: str, model: str | None = None):
        served = head.models.pick(model, "image")
        if not served.lora.remove(name):
            added = sorted(served.lora.added) or "none"
            raise HTTPException(404, f"LoRA {shown(name)} was not loaded at run time here (loaded: {added})")
        return {"object": "lora", "name": name, "model": served.name, "deleted": True}
