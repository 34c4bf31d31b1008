"""Rendering a Jinja chat template, for the family tokenizers that are not transformers
tokenizers (same sandbox and whitespace settings transformers uses)."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=16)
def _compile(template: str):
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool,
                         **kwargs) -> str:
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **kwargs)
