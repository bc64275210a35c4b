"""The request fields that constrain the output, as one `StructuredOutput`:

    response_format     {"type": "json_object"} | {"type": "json_schema", "json_schema":
                        {"name": ..., "schema": {...}, "strict": ...}} | {"type": "text"}
    structured_outputs  vLLM's: {"json": schema} | {"json_object": true} | {"regex": ...}
                        | {"choice": [...]} | {"grammar": ...}
    guided_*            vLLM's old names: refused with a 400 naming structured_outputs (vLLM
                        now ignores them silently and returns unconstrained text)

    tools[i].function.parameters
                        checked whatever tool_choice is (check_tool_schemas)

Every error is a 400 naming the field it is about, and the grammar is compiled (and probed:
sched/structured/backend.py) before the request is queued, so a schema the library cannot
enforce, one that matches nothing or one past the limits of sched/structured/limits.py is a
400 too, never a failed request mid-stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from hybridkv.engine.engine import LLMEngine
from hybridkv.sched.structured import StructuredOutput
from hybridkv.sched.structured.backend import check_json_schema
from hybridkv.server import protocol as p
from hybridkv.server.errors import APIError, bad_request
from hybridkv.server.tools import Tool

# vLLM's structured_outputs fields -> ours
_STRUCTURED_FIELDS = {"json_": "json_schema", "json_object": "json_object", "regex": "regex",
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


def from_response_format(value: p.ResponseFormat) -> StructuredOutput | None:
    if value.type != "json_schema":
        if value.json_schema is not None:
            raise bad_request(f"response_format.json_schema is only read with type "
                              f"json_schema, not {value.type}", "response_format")
        return None if value.type == "text" else _spec({"json_object": True},
                                                        "response_format")
    if value.json_schema is None or value.json_schema.schema_ is None:
        raise bad_request("response_format.json_schema.schema is missing: type json_schema "
                          "needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                          "response_format")
    return _spec({"json_schema": value.json_schema.schema_},
                 "response_format.json_schema.schema")


def from_structured_outputs(value: p.StructuredOutputsParams) -> StructuredOutput:
    values = {ours: getattr(value, name) for name, ours in _STRUCTURED_FIELDS.items()}
    return _spec({k: v for k, v in values.items() if v is not None and v is not False},
                 "structured_outputs")


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
    """Compile on the engine's grammar threads (the engine finds it cached), checks and a
    probe of the grammar included (sched/structured/backend.py); a spec the library
    refuses is a 400 naming `param`."""
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


async def check_tool_schemas(tools: Sequence[Tool]) -> None:
    """Every tool's parameters, whatever tool_choice says: a schema that is invalid or
    matches nothing is a 400 before the request is queued (with tool_choice auto or none
    the model is shown it, not held to it, so keywords the grammar library cannot enforce
    pass). Off the event loop: a big schema takes milliseconds."""
    for i, tool in enumerate(tools):
        try:
            await asyncio.to_thread(check_json_schema, tool.parameters)
        except ValueError as e:
            raise bad_request(f"tools[{i}].function.parameters: {e}", "tools") from None
