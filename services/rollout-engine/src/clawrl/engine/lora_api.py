"""SGLang's LoRA routes of the CPU engine: POST /load_lora_adapter {lora_name, lora_path,
pinned?} and POST /unload_lora_adapter {lora_name}, both answered with SGLang's
LoRAUpdateOutput `{success, error_message, loaded_adapters}` (400 when success is false)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from clawrl.engine.cpu.engine import LoraUpdate
from clawrl.engine.protocol import parse


class LoadLoraAdapterRequest(BaseModel):
    """SGLang's LoadLoRAAdapterReqInput."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    pinned: bool = False


class UnloadLoraAdapterRequest(BaseModel):
    """SGLang's UnloadLoRAAdapterReqInput."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str = Field(min_length=1)


def lora_reply(result: LoraUpdate) -> JSONResponse:
    return JSONResponse(
        {
            "success": result.success,
            "error_message": result.error_message,
            "loaded_adapters": result.loaded_adapters,
        },
        status_code=200 if result.success else 400,
    )


def build_lora_router(app_state, read_body) -> APIRouter:
    """The two routes over the app's engine; `read_body(request)` -> the parsed JSON body."""
    router = APIRouter()

    @router.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        body = parse(LoadLoraAdapterRequest, await read_body(request))
        result = await app_state.engine.load_lora_adapter(
            body.lora_name, body.lora_path, body.pinned
        )
        return lora_reply(result)

    @router.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        body = parse(UnloadLoraAdapterRequest, await read_body(request))
        return lora_reply(await app_state.engine.unload_lora_adapter(body.lora_name))

    return router
