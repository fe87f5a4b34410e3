"""Render a chat template as transformers' ``apply_chat_template`` does (same text, hence the
same token ids), and find the characters each message contributes.

Chat templates are untrusted code: they run in Jinja's immutable sandbox, with the settings
and helpers transformers gives them (``trim_blocks``, ``lstrip_blocks``, loop controls,
``raise_exception``, an unescaped ``tojson``, ``strftime_now``, ``{% generation %}`` blocks).
"""

from __future__ import annotations

import functools
import json
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from loomax.errors import DataSourceError


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body (the marks transformers
    uses for its assistant mask; the mask here comes from the message spans)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in the sandbox (cached by its text)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise DataSourceError(f"chat template: line {e.lineno}: {e.message}") from e


def render(
    source: str, messages: list[dict], special: dict[str, str], *, add_generation_prompt=False
) -> str:
    """The text of ``messages`` under the template ``source``; ``special`` holds the
    tokenizer's special tokens as the template sees them (``bos_token``, ``eos_token``, ...)."""
    try:
        return compile_template(source).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **special
        )
    except jinja2.TemplateError as e:
        raise DataSourceError(f"chat template: {e}") from e


def _prefix(source, messages, special, generation: bool) -> str | None:
    """The rendering of the first turns, or None where the template refuses so few (e.g. one
    that reads ``messages[0]``: the first span then starts at 0)."""
    try:
        return render(source, messages, special, add_generation_prompt=generation)
    except DataSourceError:
        return None


def message_spans(
    source: str, messages: list[dict], special: dict[str, str]
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the characters ``[start, end)`` of each message in it.

    Message ``i`` spans from the end of the conversation rendered up to it (with the
    generation prompt when ``i`` is the assistant's: the header is the prompt, not the
    answer) to the end of the conversation rendered through it, so an assistant's span is
    what a model generates after the prompt, its end-of-turn marker included. A template
    whose renderings are not prefixes of one another cannot be masked this way: refused.
    """
    text = render(source, messages, special)
    spans, end = [], 0
    for i, message in enumerate(messages):
        before = _prefix(source, messages[:i], special, message["role"] == "assistant")
        before = text[:end] if before is None else before
        through = render(source, messages[: i + 1], special) if i + 1 < len(messages) else text
        if not (text.startswith(through) and through.startswith(before)):
            raise DataSourceError(
                f"chat template: the conversation rendered up to message {i} is not a prefix "
                "of the whole (the template renders earlier turns differently once later "
                "ones exist); the loss mask needs prefix-stable renderings"
            )
        spans.append((max(len(before), end), len(through)))
        end = len(through)
    return text, spans
