"""The request fields that constrain the output, as one `StructuredOutput`:

    response_format     {"type": "json_object"} | {"type": "json_schema", "json_schema":
                        {"name": ..., "schema": {...}, "strict": ...}} | {"type": "text"}
    structured_outputs  vLLM's: {"json": schema} | {"json_object": true} | {"regex": ...}
                        | {"choice": [...]} | {"grammar": ...}
    guided_*            vLLM's old names: refused with a 400 naming structured_outputs (vLLM
                        now ignores them silently and returns unconstrained text)

Every error is a 400 naming the field it is about, and the grammar is compiled before the
request is queued, so a schema the library cannot enforce is a 400 too, never a failed
request mid-stream.
"""

from __future__ import annotations

import asyncio
from typing import Any

from hybridkv.engine.engine import LLMEngine
from hybridkv.sched.structured import StructuredOutput
from hybridkv.server import protocol as p
from hybridkv.server.errors import APIError, bad_request

# vLLM's structured_outputs keys -> ours
_STRUCTURED_KEYS = {"json": "json_schema", "json_object": "json_object", "regex": "regex",
                    "choice": "choice", "grammar": "grammar"}
LEGACY_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar", "guided_decoding_backend": None}


def refuse_legacy(body: p.SamplingFields) -> None:
    for name, key in LEGACY_FIELDS.items():
        if getattr(body, name, None) is not None:
            hint = f'{{"{key}": ...}}' if key else "its fields"
            raise bad_request(f"'{name}' is no longer supported: send structured_outputs "
                              f"{hint} instead", name)


def _spec(values: dict[str, Any], param: str) -> StructuredOutput:
    try:
        return StructuredOutput(**values)
    except ValueError as e:
        raise bad_request(_rename(str(e), param), param) from None


def _rename(message: str, param: str) -> str:
    """The engine names `structured_output.<kind>`; the client sent `param`."""
    if message.startswith("structured_output"):
        head, _, rest = message.partition(": ")
        return f"{param}: {rest}" if rest else message.replace("structured_output", param, 1)
    return f"{param}: {message}"


def from_response_format(value: dict[str, Any]) -> StructuredOutput | None:
    kind = value.get("type")
    if kind in (None, "text"):
        if kind is None:
            raise bad_request("response_format.type is missing (text, json_object or "
                              "json_schema)", "response_format")
        return None
    if kind == "json_object":
        return _spec({"json_object": True}, "response_format")
    if kind != "json_schema":
        raise bad_request(f"response_format.type must be text, json_object or json_schema, "
                          f"got {kind!r}", "response_format")
    wrapper = value.get("json_schema")
    if not isinstance(wrapper, dict):
        raise bad_request("response_format.json_schema must be an object with 'name' and "
                          "'schema'", "response_format")
    schema = wrapper.get("schema")
    if not isinstance(schema, dict):
        raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                          "response_format")
    return _spec({"json_schema": schema}, "response_format.json_schema.schema")


def from_structured_outputs(value: dict[str, Any]) -> StructuredOutput:
    unknown = sorted(k for k in value if k not in _STRUCTURED_KEYS)
    if unknown:
        raise bad_request(f"unknown structured_outputs field(s) {', '.join(unknown)}; "
                          f"accepted: {', '.join(_STRUCTURED_KEYS)}", "structured_outputs")
    values = {_STRUCTURED_KEYS[k]: v for k, v in value.items()
              if v is not None and v is not False}
    return _spec(values, "structured_outputs")


def request_spec(body: p.SamplingFields) -> tuple[StructuredOutput | None, str]:
    """(the spec the request asks for, the field it came from)."""
    refuse_legacy(body)
    found: list[tuple[StructuredOutput, str]] = []
    if body.response_format is not None:
        spec = from_response_format(body.response_format)
        if spec is not None:
            param = "response_format.json_schema.schema" if spec.json_schema is not None \
                else "response_format"
            found.append((spec, param))
    if body.structured_outputs is not None:
        found.append((from_structured_outputs(body.structured_outputs),
                      "structured_outputs"))
    if len(found) > 1:
        raise bad_request("response_format and structured_outputs both constrain the output: "
                          "send one", "structured_outputs")
    return found[0] if found else (None, "")


async def compile_or_400(engine: LLMEngine, spec: StructuredOutput, param: str) -> None:
    """Compile on the engine's grammar threads (the engine finds it cached); a spec the
    library refuses is a 400 naming `param`."""
    if engine.structured is None:
        raise bad_request("structured output needs the model's tokenizer, and this model has "
                          "none", param.split(".")[0])
    try:
        await asyncio.wrap_future(engine.structured.compile(spec))
    except ValueError as e:
        raise bad_request(_rename(str(e), param), param.split(".")[0]) from None
    except Exception as e:  # the library itself failed: still this request's alone
        raise APIError(500, f"the grammar failed to compile: {type(e).__name__}: {e}",
                       param=param.split(".")[0]) from None
