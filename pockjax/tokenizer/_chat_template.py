"""Chat templates rendered as transformers renders them: its sandboxed Jinja environment
and helpers, the conversation reduced to plain JSON data, and the mask of the tokens an
assistant turn covers.

`pockjax.tokenizer.Tokenizer` compiles its template with `compile_template`, catches
`template_errors()` while rendering, and marks the assistant's tokens with
`assistant_mask`; jinja2 is imported on first use only.
"""
from __future__ import annotations

import datetime
import functools
import json

import numpy as np

from pockjax.tokenizer._config import TokenizerError

def plain(value):
    """`value` rebuilt from JSON types: chat templates are untrusted code, and the sandbox
    does not know which methods of arbitrary objects are harmful."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, np.generic):
        return plain(value.item())
    for kind in (bool, str, int, float):
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return f"<{type(value).__name__}>"


@functools.cache
def jinja():
    """jinja2 and the exception `raise_exception` raises; imported on first use, since
    only chat templates need it."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ImportError("rendering chat templates needs jinja2: pip install 'jinja2>=3.1.6'"
                          ) from None
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < (3, 1, 6):
        # Older versions have known sandbox escapes, and templates are untrusted code.
        raise ImportError(f"rendering chat templates needs jinja2>=3.1.6 (found "
                          f"{jinja2.__version__}): pip install -U jinja2")

    class TemplateRaised(jinja2.TemplateError):
        pass

    return jinja2, TemplateRaised


def template_errors() -> tuple[type[Exception], ...]:
    """What a template that is wrong for its input raises: Jinja's errors, and Python's
    from operations in the template (`'a' + 1`, `messages[9]`)."""
    return (jinja()[0].TemplateError, ArithmeticError, LookupError, TypeError, ValueError,
            AttributeError)


@functools.cache
def _environment():
    """The sandboxed Jinja environment with transformers' helpers, built once."""
    jinja2, raised = jinja()

    class Generation(jinja2.ext.Extension):
        # transformers marks assistant text with {% generation %}; rendering keeps the body.
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class Namespace(jinja2.utils.Namespace):
        # Underscore names could reach CPython internals through the namespace.
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            for name in dict(*args, **kwargs):
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, *args, **kwargs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a "
                    f"namespace, got {name!r}")

    class Dict:
        # dict itself would hand the template the type object.
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise raised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters, which a prompt must keep.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=Dict(), namespace=Namespace)
    return env


@functools.lru_cache(maxsize=16)
def compile_template(template: str, where: str):
    """`template` compiled in the sandbox (cached); `where` names it in a syntax error."""
    jinja2, _ = jinja()
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"the chat template in {where} is not valid Jinja: {e.message} "
                             f"(template line {e.lineno})") from None


def assistant_mask(offsets, spans: list[tuple[int, int]]) -> list[bool]:
    """True for each token whose characters overlap a span (as transformers' assistant
    mask does); a token of no characters counts where it stands."""
    mask = []
    for start, end in offsets:
        if end > start:
            mask.append(any(start < b and end > a for a, b in spans))
        else:
            mask.append(any(a <= start < b for a, b in spans))
    return mask
