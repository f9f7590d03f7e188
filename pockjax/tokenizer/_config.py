"""Reading a model folder's `tokenizer_config.json` as transformers 5 does: its special
tokens, added tokens and chat templates, and registering those tokens with the
`tokenizers` pipeline so that it encodes as transformers' tokenizer.

`pockjax.tokenizer.Tokenizer.from_folder` and `from_tokenizer` call these; `TokenizerError`
lives here so that the chat-template helpers (`pockjax.tokenizer._chat_template`) raise it too, and
`pockjax.tokenizer` re-exports it.
"""
from __future__ import annotations

import json
from pathlib import Path

import tokenizers

# The named special tokens transformers knows; a config may name model-specific ones too
# (any other "*_token" string, or a dict under "extra_special_tokens").
_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
          "mask_token")


class TokenizerError(ValueError):
    """Raised for a tokenizer folder, chat template or conversation pockjax cannot use;
    the message names the file or message and what to do."""


def read_json(path: Path):
    """The JSON in `path`; a file that is not JSON is a `TokenizerError`."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TokenizerError(f"'{path}' is not valid JSON: {e}; re-save the tokenizer with "
                             f"transformers or fix the file") from None


def token_content(token) -> str | None:
    """The text of a special token given as a string or an AddedToken-like object."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _added_token(token, special: bool | None = None) -> tokenizers.AddedToken:
    """A token of the config (a string or an AddedToken-like object) as an `AddedToken`;
    `special` overrides its flag."""
    if isinstance(token, dict):
        flags = {k: token[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special")
                 if k in token}
        if special is not None:
            flags["special"] = special
        return tokenizers.AddedToken(token["content"], **flags)
    # transformers registers special tokens named by a bare string as matched before
    # normalization.
    return tokenizers.AddedToken(token, special=True if special is None else special,
                                 normalized=False)


def config_special_tokens(config: dict, path) -> tuple[dict, list]:
    """The named special tokens (standard and model-specific) and the unnamed extra ones,
    as transformers 5 collects them from tokenizer_config.json."""
    def check(name, value):
        if not (isinstance(value, str) or (isinstance(value, dict)
                                           and isinstance(value.get("content"), str))):
            raise TokenizerError(f"'{path}': \"{name}\" must be a string or an object with "
                                 f"\"content\", got {value!r:.80}")

    special = {}
    for name, value in config.items():
        if value is None:
            continue
        if name in _NAMED:
            check(name, value)
            special[name] = value
        elif name.endswith("_token") and (isinstance(value, str) or (
                isinstance(value, dict) and isinstance(value.get("content"), str))):
            special[name] = value
    extra = config.get("extra_special_tokens", config.get("additional_special_tokens")) or []
    if isinstance(extra, dict):
        for name, value in extra.items():
            check(f"extra_special_tokens.{name}", value)
            special.setdefault(name, value)
        extra = []
    if not isinstance(extra, list):
        raise TokenizerError(f"'{path}': \"extra_special_tokens\" must be a list, got "
                             f"{extra!r:.80}")
    for value in extra:
        check("extra_special_tokens", value)
    return special, extra


def register_tokens(backend: tokenizers.Tokenizer, config: dict, special: dict,
                     extra: list) -> None:
    """Make `backend` encode as transformers' tokenizer built from the same files: the
    config's added tokens that tokenizer.json lacks and every special token it names are
    added, and padding and truncation stored in tokenizer.json are off (transformers turns
    them off for a call that asks for neither)."""
    present = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = [_added_token(t) for t in (config.get("added_tokens_decoder") or {}).values()
               if isinstance(t, dict) and t.get("content") not in present]
    if missing:
        backend.add_tokens(missing)
    tokens = [_added_token(v, special=True) for v in [*special.values(), *extra]]
    if tokens:
        backend.add_special_tokens(tokens)
    backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
    backend.no_padding()
    backend.no_truncation()


def config_templates(config: dict, path) -> tuple[dict[str, str], str | None]:
    """The config's chat templates by name (one string is "default") and where they came
    from, for messages."""
    template = config.get("chat_template")
    if template is None:
        return {}, None
    if isinstance(template, str):
        return {"default": template}, str(path)
    if isinstance(template, list) and all(
            isinstance(t, dict) and isinstance(t.get("name"), str)
            and isinstance(t.get("template"), str) for t in template):
        return {t["name"]: t["template"] for t in template}, str(path)
    raise TokenizerError(f"'{path}': \"chat_template\" must be a string or a list of "
                         f"{{\"name\", \"template\"}} objects, got {template!r:.80}")
