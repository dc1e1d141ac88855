"""Request and response bodies of the OpenAI-compatible routes (pydantic v2).

Request models check types and static bounds only; configurable limits (``AdmissionLimits``) and
model rules (``Family.resolve``) are applied by the route. JSON bodies are strict (``"2"`` is not an
int); multipart forms carry strings, so their models coerce. Unknown fields are refused, as
OpenAI's API does, so a misspelt extra parameter is an error rather than silently ignored. OpenAI
fields that Triptych does not use (``quality``, ``style``, ``user``, ...) are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from triptych.accel.teacache_profile import AUTO_THRESHOLD
from triptych.head.tenancy import MAX_DEADLINE_S, PRIORITY_MAX, PRIORITY_MIN

FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
#: A number in [0, 2] or "auto" (the calibration profile's recommended threshold), which the model
#: maps to ``AUTO_THRESHOLD``; the denoiser resolves it against its profile (400 when there is none).
TeaCacheThreshold = Annotated[float, Field(ge=0, le=2, allow_inf_nan=False)] | Literal["auto"]
Seed = Annotated[int, Field(ge=0, le=2**62, description="random seed; n>1 uses seed, seed+1, ...")]
MAX_TEXT = 1_000_000  # hard cap of any string; the configurable limit is AdmissionLimits.max_prompt_chars
#: The request's priority class (vLLM's convention: lower runs sooner; default: its API key's, 0);
#: its API key may allow a narrower range (``HeadConfig.tenant_policies``).
Priority = Annotated[
    int,
    Field(
        ge=PRIORITY_MIN, le=PRIORITY_MAX, description="priority class: lower runs sooner; default: the API key's (0)"
    ),
]
#: Seconds from its arrival the client can wait (default: the model's ``--slo``): refused at once
#: (429) when the head estimates it cannot finish in time, dropped (504) when it passes before the
#: request starts denoising.
DeadlineS = Annotated[
    float,
    Field(
        gt=0,
        le=MAX_DEADLINE_S,
        allow_inf_nan=False,
        description="seconds from arrival the client can wait: refused (429) if it cannot be met",
    ),
]


def _auto_threshold(v):
    return AUTO_THRESHOLD if v == "auto" else v


class LoraItem(BaseModel):
    """One adapter of a request and its scale (the head checks the name and the scale's range)."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=256)
    scale: FiniteFloat = 1.0


#: Other spellings of an output format that mean the same one (formats are case-insensitive).
FORMAT_SPELLINGS = {"jpg": "jpeg"}


def _lower_name(v):
    """``"PNG"``/``"Jpg"`` as ``"png"``/``"jpeg"``: a format's name in any case means the same format."""
    if isinstance(v, str):
        low = v.strip().lower()
        return FORMAT_SPELLINGS.get(low, low)
    return v


def _lora_list(v):
    """A multipart form carries the list as JSON text."""
    if isinstance(v, str) and v.lstrip().startswith("["):
        import json

        return json.loads(v)
    return v


class _GenerationFields(BaseModel):
    """Fields shared by image generations and edits (OpenAI's plus Triptych's extras)."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=MAX_TEXT)
    model: str | None = Field(
        None, description="served model id (see GET /v1/models); default: the first that does the job"
    )
    n: int | None = Field(1, ge=1, description="images to generate; each is one job")
    size: str | None = Field(None, max_length=64, description='"WIDTHxHEIGHT" or "auto" (model default)')
    response_format: Literal["b64_json", "url"] | None = "b64_json"
    output_format: Literal["png", "jpeg", "webp"] | None = Field(
        "png", description="png|jpeg|webp, any case (jpg = jpeg)"
    )
    _formats = field_validator("output_format", "response_format", mode="before")(_lower_name)
    # Triptych extras (extra_body in the OpenAI SDK)
    seed: Seed | None = None
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: FiniteFloat | None = Field(None, ge=0)
    negative_prompt: str | None = Field(None, max_length=MAX_TEXT)
    true_cfg_scale: FiniteFloat | None = Field(None, ge=0)
    teacache_threshold: TeaCacheThreshold | None = Field(
        None, description='0 = TeaCache off; "auto" = the profile\'s recommendation; needs a calibration profile'
    )
    _threshold = field_validator("teacache_threshold")(_auto_threshold)
    lora: Annotated[str, Field(min_length=1, max_length=256)] | list[LoraItem] | None = Field(
        None, description='LoRA adapters (extra): a served adapter name, or [{"name": ..., "scale": ...}, ...]'
    )
    _lora = field_validator("lora", mode="before")(_lora_list)
    output_compression: int | None = Field(
        None, ge=0, le=100, description="jpeg/webp quality, 0-100 (100: least compression); default 95"
    )
    result_cache: bool | None = Field(
        None, description="false: never answered from, nor stored in, the head's result cache (needs a seed)"
    )
    priority: Priority | None = None
    deadline_s: DeadlineS | None = None
    # OpenAI fields accepted and ignored
    user: str | None = Field(None, max_length=256)
    quality: str | None = Field(None, max_length=32)
    style: str | None = Field(None, max_length=32)
    moderation: str | None = Field(None, max_length=32)
    safety_identifier: str | None = Field(None, max_length=256)
    background: Literal["auto", "opaque"] | None = None
    stream: bool | None = Field(None, description="server-sent events: partial images, then the final image")
    partial_images: int | None = Field(
        None, ge=0, le=3, description="stream=true: previews decoded from intermediate steps before the final image"
    )


class ImageGenerationRequest(_GenerationFields):
    """``POST /v1/images/generations`` (JSON)."""

    model_config = ConfigDict(strict=True)
    style: Literal["vivid", "natural"] | None = None


class ImageEditForm(_GenerationFields):
    """``POST /v1/images/edits`` multipart fields other than the files (``image``)."""

    model_config = ConfigDict(strict=False)
    input_fidelity: str | None = Field(None, max_length=32)
    url: str | None = Field(
        None,
        max_length=64 * 1024 * 1024,
        description="the image as a base64 data: URL instead of a file (vLLM-Omni's field)",
    )


class VideoCreateRequest(BaseModel):
    """``POST /v1/videos`` fields (JSON or multipart) other than an uploaded ``input_reference``."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(min_length=1, max_length=MAX_TEXT)
    model: str | None = None
    size: str | None = Field(None, max_length=64, description='"WIDTHxHEIGHT" or "auto"')
    seconds: Annotated[float, Field(gt=0, le=3600, allow_inf_nan=False)] | None = Field(
        None,
        description="clip length, at least one frame (1/fps); frames = the first count >= seconds*fps the model accepts",
    )
    frames: int | None = Field(None, ge=1, description="exact frame count (overrides seconds)")
    fps: int | None = Field(
        None, ge=1, le=120, description="frame rate of this video (default: the server's --video-fps)"
    )
    # the peers' names (vLLM-Omni, diffusers) for the same knobs; given with Triptych's, they must agree
    num_frames: int | None = Field(None, ge=1, description="= frames (vLLM-Omni's and diffusers' name)")
    width: int | None = Field(None, ge=1, description="with height: = size WIDTHxHEIGHT (vLLM-Omni's names)")
    height: int | None = Field(None, ge=1, description="with width: = size WIDTHxHEIGHT (vLLM-Omni's names)")
    seed: Seed | None = None
    num_inference_steps: int | None = Field(None, ge=1)
    guidance_scale: FiniteFloat | None = Field(None, ge=0)
    negative_prompt: str | None = Field(None, max_length=MAX_TEXT)
    true_cfg_scale: FiniteFloat | None = Field(None, ge=0)
    teacache_threshold: TeaCacheThreshold | None = None
    _threshold = field_validator("teacache_threshold")(_auto_threshold)
    result_cache: bool | None = Field(
        None, description="false: never answered from, nor stored in, the head's result cache (needs a seed)"
    )
    input_reference: ImageReference | None = Field(None, description="JSON form of the condition image")
    image_reference: ImageReference | None = Field(None, description="= input_reference (a peer's name)")
    priority: Priority | None = None
    deadline_s: DeadlineS | None = None


class ImageReference(BaseModel):
    """A condition image given by reference: only base64 ``data:`` URLs (the head fetches nothing)."""

    model_config = ConfigDict(extra="forbid")
    image_url: str | None = Field(None, max_length=64 * 1024 * 1024)
    file_id: str | None = Field(None, max_length=256)


VideoCreateRequest.model_rebuild()


class ChatImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(max_length=64 * 1024 * 1024, description="a base64 data: URL (the head fetches nothing)")
    detail: Literal["auto", "low", "high"] | None = None  # accepted; the processor decides the resolution


class ChatTextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT)


class ChatImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ChatImageURL


class ChatVideoURL(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(
        max_length=64 * 1024 * 1024,
        description="a base64 data: URL (data:video/mp4;base64,...), a /v1/files id (file-...) of an MP4, "
        "or the id of a completed /v1/videos job (video_...); the head fetches nothing",
    )


class ChatVideoPart(BaseModel):
    """A video clip (vLLM's and SGLang's ``video_url`` part); sampled frames reach the VLM as images."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["video_url"]
    video_url: ChatVideoURL
    fps: FiniteFloat | None = Field(None, gt=0, le=60, description="frames sampled per second of the clip (extra)")
    max_frames: int | None = Field(
        None, ge=1, description="most frames sampled (extra; at most the server's max_chat_video_frames)"
    )


ChatPart = Annotated[ChatTextPart | ChatImagePart | ChatVideoPart, Field(discriminator="type")]


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ChatPart] = Field(max_length=MAX_TEXT)
    name: str | None = Field(None, max_length=256)  # accepted and ignored


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # strict like its request: "yes" is no bool
    include_usage: bool | None = None


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions`` (JSON). OpenAI fields that would change the answer in ways the
    server does not implement (``n`` > 1, ``stop``, penalties, tools, logprobs, JSON mode) are
    refused by the route rather than silently ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)

    messages: list[ChatMessageIn] = Field(min_length=1, max_length=256)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: FiniteFloat | None = Field(None, ge=0, le=2, description="0 = greedy (the default)")
    top_p: FiniteFloat | None = Field(None, gt=0, le=1)
    seed: Seed | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    presence_penalty: FiniteFloat | None = None
    frequency_penalty: FiniteFloat | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    # Triptych extras (vLLM's names)
    ignore_eos: bool | None = Field(None, description="generate exactly max_tokens tokens (load tests)")
    priority: Priority | None = None
    # accepted and ignored
    user: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = Field(None, max_length=32)
    safety_identifier: str | None = Field(None, max_length=256)


#: Unknown request fields that other servers take, → the Triptych field for the same knob (the 400
#: that refuses them says which to use).
PEER_HINTS = {
    "num_images_per_prompt": "n",
    "width": "size",
    "height": "size",
    "num_frames": "frames",
    "generator": "seed",
}


def inline_schema(model: type[BaseModel]) -> dict:
    """The model's JSON schema with ``$defs`` inlined, for hand-written OpenAPI request bodies (a
    ``#/$defs/...`` reference would resolve against the OpenAPI document, not this schema)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node and node["$ref"].startswith("#/$defs/"):
                return walk(defs[node["$ref"].rsplit("/", 1)[1]])
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


# ---- responses ---------------------------------------------------------------------------------
class ImageData(BaseModel):
    b64_json: str | None = None
    url: str | None = None
    revised_prompt: str | None = None


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]
    output_format: str
    size: str
    seeds: list[int] = Field(description="the seed of each image, in order (Triptych extra)")
    expires_at: int | None = Field(None, description="when url links stop working (Triptych extra)")
    warnings: list[str] | None = Field(
        None, description="notes on the result, e.g. a size the model was not trained at (Triptych extra)"
    )


class VideoError(BaseModel):
    code: str
    message: str


class VideoObject(BaseModel):
    id: str
    object: Literal["video"] = "video"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled"]
    progress: int
    model: str
    prompt: str | None = None
    seconds: str
    size: str
    frames: int
    completed_at: int | None = None
    expires_at: int | None = None
    error: VideoError | None = None
    warnings: list[str] | None = Field(
        None, description="create only: notes, e.g. a size the model was not trained at (Triptych extra)"
    )


class VideoList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "triptych"
    family: str = Field(description="Triptych family adapter name (extra)")
    kind: Literal["image", "image+edit", "image-edit", "video"] = Field(
        description="what the model does (extra): image (generates), image+edit (generates and edits), "
        "image-edit (edits only), video"
    )
    chat: bool = Field(False, description="answers POST /v1/chat/completions with its VLM (extra)")
    loras: list[dict] = Field(
        default_factory=list,
        description="LoRA adapters requests may name (extra); loaded_on: the denoisers holding each in memory",
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    finish_reason: Literal["stop", "length"]


class ChatUsage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage
    seed: int = Field(description="the sampling seed used (Triptych extra)")
