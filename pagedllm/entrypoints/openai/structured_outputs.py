"""A request's output constraint -> `SamplingParams.structured_outputs`.

Clients ask in several spellings: OpenAI's `response_format`, vLLM's `structured_outputs`
object, vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`,
and (chat) a `tool_choice` that forces a call. The engine enforces one constraint, so more
than one is a 400 naming them all, rather than a silent pick. The engine's processor checks
what only it can (a schema or grammar its backend cannot compile) and answers 400 too."""

from __future__ import annotations

from pagedllm.sampling_params import StructuredOutputsParams

from .protocol import FieldError, SamplingRequest


def _params(param: str, **kwargs) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except ValueError as e:
        raise FieldError(param, f"{param}: {e}") from None


def requested_constraints(req: SamplingRequest) -> list[tuple[str, StructuredOutputsParams]]:
    """Every constraint the request spells, with the field that spelled it."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", _params("response_format", json_object=True)))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise FieldError("response_format", "response_format of type 'json_schema' needs "
                             "json_schema.schema: the JSON Schema the answer must follow")
        found.append(("response_format", _params("response_format", json=rf.json_schema.schema_)))
    so = req.structured_outputs
    if so is not None:
        found.append(("structured_outputs", _params(
            "structured_outputs", json=so.json_, regex=so.regex, choice=so.choice,
            grammar=so.grammar, json_object=so.json_object,
            disable_any_whitespace=so.disable_any_whitespace)))
    for field, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                        ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        value = getattr(req, field)
        if value is not None:
            found.append((field, _params(field, **{kind: value})))
    return found


def structured_outputs(req: SamplingRequest,
                       extra: tuple[str, StructuredOutputsParams] | None = None
                       ) -> StructuredOutputsParams | None:
    """The one constraint of `req` (plus `extra`, e.g. the tool_choice's), or None."""
    found = requested_constraints(req) + ([extra] if extra else [])
    if len(found) > 1:
        names = [name for name, _ in found]
        raise FieldError(names[0], f"{' and '.join(names)} each constrain the output; a request "
                         "may give only one of them")
    return found[0][1] if found else None
