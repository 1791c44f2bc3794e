"""Request bodies of the engine's HTTP API and their validation into GenerationRequests.

Field names are SGLang's (`GenerateReqInput`, `SamplingParams`, `UpdateWeightFromDiskReqInput`)
and OpenAI's for /v1/chat/completions. Everything a client can get wrong is caught here and
raised as RequestError (-> 400), before anything reaches the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from clawrl.engine.generation import GenerationRequest, SamplingRow, StopCriteria


class RequestError(ValueError):
    """The client's request cannot be served as sent (HTTP 400)."""


def describe_validation_error(exc: Any) -> str:
    """`field.path: message; ...` from pydantic's errors, for a 400 body."""
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"] if p != "body") or "body"
        parts.append(f"{where}: {error['msg']}")
    return "; ".join(parts)


class SamplingParams(BaseModel):
    """SGLang's sampling_params. Unknown keys are rejected, so a typo is not silently ignored."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1 (or 0): no top-k")
    min_p: float = Field(0.0, ge=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    seed: int | None = Field(None, description="Alias of sampling_seed.")
    # Accepted so SGLang clients can send their defaults; other values are refused below.
    n: int = 1
    min_new_tokens: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None
    stream_interval: int | None = None


UNSUPPORTED_DEFAULTS = {
    "n": 1,
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
}


class GenerateRequest(BaseModel):
    """SGLang's GenerateReqInput (single request; batched lists are not supported)."""

    model_config = ConfigDict(extra="ignore")

    text: str | None = None
    input_ids: list[StrictInt] | None = None
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0)
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | None = None
    lora_path: str | list[str | None] | None = Field(
        None, description="The LoRA adapter's name (SGLang's field; a list: one per batch item)."
    )


class UpdateWeightsFromDiskRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model_path: str = Field(min_length=1)
    load_format: str | None = None
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class InitWeightsUpdateGroupRequest(BaseModel):
    """SGLang's /init_weights_update_group (the CPU engine joins over gloo)."""

    model_config = ConfigDict(extra="ignore")

    master_address: str = Field(min_length=1)
    master_port: int = Field(gt=0, lt=65536)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class DestroyWeightsUpdateGroupRequest(BaseModel):
    """SGLang's /destroy_weights_update_group."""

    model_config = ConfigDict(extra="ignore")

    group_name: str = "weight_update_group"


class UpdateWeightsFromDistributedRequest(BaseModel):
    """SGLang's /update_weights_from_distributed: the tensors rank 0 broadcasts next."""

    model_config = ConfigDict(extra="ignore")

    names: list[str] = Field(min_length=1)
    dtypes: list[str]  # checked by the engine, which refuses with SGLang's reply shape
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False

    @model_validator(mode="after")
    def _same_lengths(self) -> UpdateWeightsFromDistributedRequest:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError("names, dtypes and shapes must have the same length")
        return self


class PauseGenerationRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    mode: Literal["abort", "retract", "in_place"] = "abort"


class ChatCompletionRequest(BaseModel):
    """OpenAI's chat completion request (plus SGLang's top_k/min_p/ignore_eos extensions)."""

    model_config = ConfigDict(extra="ignore")

    messages: list[dict[str, Any]] = Field(min_length=1)
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    lora_path: str | None = Field(
        None,
        description="The LoRA adapter's name (SGLang's extension); `model` written "
        "`base-model:adapter-name` names one too, and wins.",
    )


@dataclass(frozen=True)
class Limits:
    """What the served model accepts."""

    vocab_size: int
    context_length: int
    default_max_new_tokens: int
    eos_token_ids: frozenset[int]


def parse(model: type[BaseModel], body: Any) -> Any:
    """A pydantic model from a JSON body, or RequestError with every problem named."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestError(describe_validation_error(exc)) from exc


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    strings = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in strings):
        raise RequestError("stop strings must not be empty")
    return tuple(strings)


def _check_prompt(ids: list[int], limits: Limits) -> None:
    if not ids:
        raise RequestError("the prompt is empty (no input tokens)")
    bad = [i for i in ids if not 0 <= i < limits.vocab_size]
    if bad:
        raise RequestError(f"input_ids out of the vocabulary [0, {limits.vocab_size}): {bad[:5]}")
    if len(ids) >= limits.context_length:
        raise RequestError(
            f"the prompt has {len(ids)} tokens; the context length is {limits.context_length}"
        )


def _max_new_tokens(requested: int | None, prompt_len: int, limits: Limits, default: int) -> int:
    room = limits.context_length - prompt_len
    if requested is None:
        return min(default, room)
    if prompt_len + requested > limits.context_length:
        raise RequestError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({requested}) exceeds the context "
            f"length ({limits.context_length})"
        )
    return requested


def _check_stop_ids(ids: list[int] | None, limits: Limits) -> frozenset[int]:
    bad = [i for i in ids or [] if not 0 <= i < limits.vocab_size]
    if bad:
        raise RequestError(f"stop_token_ids out of the vocabulary: {bad[:5]}")
    return frozenset(ids or [])


def generation_request(req: GenerateRequest, tokenize, limits: Limits) -> GenerationRequest:
    """Validate a /generate body against the model; `tokenize(text) -> ids`."""
    if (req.text is None) == (req.input_ids is None):
        raise RequestError("give exactly one of `text` and `input_ids`")
    params = req.sampling_params
    for name, default in UNSUPPORTED_DEFAULTS.items():
        if getattr(params, name) != default:
            raise RequestError(f"sampling_params.{name} is not supported by the CPU engine")
    if req.text is not None and not req.text:
        raise RequestError("`text` is empty")
    ids = list(req.input_ids) if req.input_ids is not None else tokenize(req.text)
    _check_prompt(ids, limits)
    max_new = _max_new_tokens(
        params.max_new_tokens, len(ids), limits, limits.default_max_new_tokens
    )
    if req.return_logprob and req.logprob_start_len > len(ids):
        raise RequestError(
            f"logprob_start_len ({req.logprob_start_len}) is beyond the prompt ({len(ids)} tokens)"
        )
    if req.top_logprobs_num > limits.vocab_size:
        raise RequestError(f"top_logprobs_num must be at most {limits.vocab_size}")
    seed = params.sampling_seed if params.sampling_seed is not None else params.seed
    return GenerationRequest(
        lora_path=_single_adapter(req.lora_path),
        input_ids=ids,
        sampling=SamplingRow(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else -1,
            min_p=params.min_p,
        ),
        stop=StopCriteria(
            max_new_tokens=max_new,
            stop_token_ids=_check_stop_ids(params.stop_token_ids, limits),
            eos_token_ids=limits.eos_token_ids,
            ignore_eos=params.ignore_eos,
            stop_strings=_stop_strings(params.stop),
        ),
        seed=seed,
        return_logprob=req.return_logprob,
        logprob_start_len=req.logprob_start_len if req.return_logprob else -1,
        top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
        return_text_in_logprobs=req.return_text_in_logprobs,
        skip_special_tokens=params.skip_special_tokens,
        no_stop_trim=params.no_stop_trim,
        stream=req.stream,
        **({"rid": req.rid} if req.rid else {}),
    )


def _single_adapter(lora_path: str | list[str | None] | None) -> str | None:
    """The adapter of a single request: a name, or a one-item list (SGLang's batch form)."""
    if isinstance(lora_path, list):
        if len(lora_path) != 1:
            raise RequestError(
                f"lora_path lists {len(lora_path)} adapters for one request (batched "
                "requests are not supported)"
            )
        lora_path = lora_path[0]
    if lora_path == "":
        raise RequestError("lora_path is empty")
    return lora_path


def chat_generation_request(
    req: ChatCompletionRequest, prompt_ids: list[int], limits: Limits, adapter: str | None = None
) -> GenerationRequest:
    """Validate a chat completion against the model, given its rendered prompt ids and the
    adapter it names (`model_adapter`). With no max_tokens the answer may use the rest of the
    context (as SGLang's OpenAI server does)."""
    if req.n != 1:
        raise RequestError("n must be 1")
    if req.frequency_penalty or req.presence_penalty:
        raise RequestError("frequency_penalty/presence_penalty are not supported by the CPU engine")
    _check_prompt(prompt_ids, limits)
    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    room = limits.context_length - len(prompt_ids)
    max_new = _max_new_tokens(requested, len(prompt_ids), limits, room)
    return GenerationRequest(
        lora_path=adapter or _single_adapter(req.lora_path),
        input_ids=prompt_ids,
        sampling=SamplingRow(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k if req.top_k > 0 else -1,
            min_p=req.min_p,
        ),
        stop=StopCriteria(
            max_new_tokens=max_new,
            stop_token_ids=_check_stop_ids(req.stop_token_ids, limits),
            eos_token_ids=limits.eos_token_ids,
            ignore_eos=req.ignore_eos,
            stop_strings=_stop_strings(req.stop),
        ),
        seed=req.seed,
        return_logprob=req.logprobs,
        top_logprobs_num=(req.top_logprobs or 0) if req.logprobs else 0,
        return_text_in_logprobs=True,
        skip_special_tokens=req.skip_special_tokens,
        stream=req.stream,
    )
