"""The tokenizer of a Hugging Face model folder, read without transformers or torch.

`pockjax finetune` gets a model folder as users download it. Its `tokenizer.json` is the
serialized Hugging Face `tokenizers` pipeline, so that light library encodes and decodes
exactly as `transformers` does; what transformers adds on top is read here from
`tokenizer_config.json` (special tokens, chat template) and reproduced: special tokens named
there are registered as transformers registers them, and chat templates are rendered in the
same sandboxed Jinja environment with the same helpers. The tests compare every method with
`transformers.AutoTokenizer` on the same folder.

`Tokenizer.encode_chat` also says which tokens of a rendered conversation are the
assistant's, so that training counts only those: it renders the conversation one prefix at
a time and maps the characters each assistant turn adds to tokens through their offsets.

Reading `tokenizer_config.json` and registering its tokens is in
`pockjax.tokenizer._config` (with `TokenizerError`, re-exported here); the Jinja sandbox
and the assistant mask are in `pockjax.tokenizer._chat_template`.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import numpy as np
import tokenizers

from pockjax._src.home import claim
from pockjax.tokenizer._chat_template import assistant_mask, compile_template, jinja, plain, \
    template_errors
from pockjax.tokenizer._config import TokenizerError, config_special_tokens, \
    config_templates, read_json, register_tokens, token_content

__all__ = ["Tokenizer", "TokenizerError"]

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONVERT_HINT = ("re-save it once as a fast tokenizer with transformers: "
                 "AutoTokenizer.from_pretrained(folder).save_pretrained(folder)")


class Tokenizer:
    """Encode, decode and render chats as `transformers` does for the same model folder.

    Build one with `Tokenizer.from_folder(model_folder)` or, from a `tokenizers.Tokenizer`
    in memory, `Tokenizer.from_tokenizer(...)`:

    >>> import tokenizers
    >>> vocab = {"<unk>": 0, "</s>": 1, "hello": 2, "world": 3}
    >>> backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    >>> backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    >>> tok = Tokenizer.from_tokenizer(backend, eos_token="</s>",
    ...     chat_template="{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    >>> tok.encode("hello world </s>"), tok.eos_id
    ([2, 3, 1], 1)
    >>> tok.encode_chat([{"role": "user", "content": "hello"},
    ...                  {"role": "assistant", "content": "world"}])
    ([2, 1, 3, 1], [False, False, True, True])

    The constructor takes the pieces as they are and registers no tokens; use
    `from_folder` or `from_tokenizer`, which register the special tokens as
    transformers does (what makes `encode` equal transformers').

    Args:
      backend: the `tokenizers.Tokenizer`, its tokens already registered.
      special: special-token name (`"bos_token"`, `"eos_token"`, ...) -> its text.
      templates: chat template name -> Jinja source; the one named "default" is used.
      config: the `tokenizer_config.json` contents (`clean_up_tokenization_spaces` is
        read from it; `save` writes it back).
      folder: the folder it was read from, for messages; None when built in memory.
      template_file: where the chat templates came from, for messages.

    Attributes:
      vocab_size: how many ids the tokenizer can produce, added tokens included
        (`len(transformers_tokenizer)`). A special token the config names but the
        vocabulary lacks is added, as transformers adds it, so this can exceed the
        model's embedding rows.
      bos_token: the beginning-of-sequence token's text, or None.
      eos_token: the end-of-sequence token's text, or None.
      pad_token: the padding token's text, or None.
      bos_id: `bos_token`'s id, or None.
      eos_id: `eos_token`'s id, or None.
      pad_id: `pad_token`'s id, or None.
      chat_template: the Jinja chat template used (the one named "default" where the
        folder has several), or None.
      backend: the `tokenizers.Tokenizer` doing the work.
    """

    def __init__(self, backend: tokenizers.Tokenizer, *, special: dict[str, str],
                 templates: dict[str, str], config: dict, folder: Path | None = None,
                 template_file: str | None = None):
        # Use from_folder / from_tokenizer: they register the special tokens, which is
        # what makes encode equal transformers'.
        self.backend = backend
        self._special = dict(special)
        self._templates = dict(templates)
        self._config = config
        self._folder = folder
        self._source = "this tokenizer" if folder is None else f"'{folder}'"
        self._template_file = template_file
        # As transformers: several named templates are used only through "default".
        self.chat_template = templates.get("default")
        self.bos_token = special.get("bos_token")
        self.eos_token = special.get("eos_token")
        self.pad_token = special.get("pad_token")
        self.bos_id = self._id(self.bos_token)
        self.eos_id = self._id(self.eos_token)
        self.pad_id = self._id(self.pad_token)
        added = backend.get_added_tokens_decoder()
        self.vocab_size = max(backend.get_vocab_size(with_added_tokens=True),
                              max(added, default=-1) + 1)
        # transformers skips its decode clean-up for BPE models (it would eat spaces
        # before punctuation) unless told to corrupt the output anyway.
        self._clean_up = bool(config.get("clean_up_tokenization_spaces")) and (
            type(backend.model).__name__ != "BPE" or bool(config.get(
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def __repr__(self) -> str:
        return (f"Tokenizer({self._source}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token!r}, eos={self.eos_token!r}, pad={self.pad_token!r}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_folder(cls, folder: str | os.PathLike) -> "Tokenizer":
        """Read the tokenizer of a Hugging Face model folder.

        Reads `tokenizer.json` and, where present, `tokenizer_config.json` (special tokens,
        given as strings or `{"content": ...}` objects; `chat_template` as a string or a
        list of `{"name", "template"}`; `split_special_tokens`;
        `clean_up_tokenization_spaces`) and `chat_template.jinja` plus
        `additional_chat_templates/*.jinja`, which take priority over the config's template
        as in transformers 5. `add_bos_token` / `add_eos_token` are ignored, as
        transformers 5 ignores them beside a `tokenizer.json`: its post-processor decides
        which special tokens `encode` adds.

        Args:
          folder: the model folder.

        Returns:
          The tokenizer.

        Raises:
          TokenizerError: `folder` is not a directory; it has no `tokenizer.json` (a
            slow-tokenizer-only folder: the message says how to convert it); a file
            there cannot be read or parsed; or `tokenizer_config.json` is not a JSON
            object or holds a special token or chat template of the wrong type.
        """
        folder = Path(folder)
        if not folder.is_dir():
            raise TokenizerError(f"tokenizer folder '{folder}' is not a directory; pass the "
                                 f"Hugging Face model folder that holds tokenizer.json")
        path = folder / "tokenizer.json"
        if not path.is_file():
            slow = [n for n in ("tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
                                "spiece.model") if (folder / n).is_file()]
            found = (f"it has only the slow-tokenizer file(s) {', '.join(slow)}"
                     if slow else "it has no tokenizer files")
            raise TokenizerError(f"'{folder}' has no tokenizer.json ({found}); pockjax reads "
                                 f"the fast-tokenizer file tokenizer.json: {_CONVERT_HINT}")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on any parse failure
            raise TokenizerError(f"'{path}' could not be read by the tokenizers library "
                                 f"({tokenizers.__version__}): {e}; if it was written by a "
                                 f"newer library, upgrade tokenizers, or {_CONVERT_HINT}") from None

        config = {}
        config_path = folder / "tokenizer_config.json"
        if config_path.is_file():
            config = read_json(config_path)
            if not isinstance(config, dict):
                raise TokenizerError(f"'{config_path}' must hold a JSON object, got "
                                     f"{type(config).__name__}")

        templates, template_file = config_templates(config, config_path)
        jinja_files = {}
        if (folder / "chat_template.jinja").is_file():
            jinja_files["default"] = folder / "chat_template.jinja"
        extra_dir = folder / "additional_chat_templates"
        if extra_dir.is_dir():
            jinja_files.update({p.name.removesuffix(".jinja"): p
                                for p in sorted(extra_dir.glob("*.jinja"))})
        if jinja_files:
            templates = {name: p.read_text(encoding="utf-8") for name, p in jinja_files.items()}
            template_file = str(jinja_files.get("default", next(iter(jinja_files.values()))))

        special, extra = config_special_tokens(config, config_path)
        register_tokens(backend, config, special, extra)
        return cls(backend, special={k: token_content(v) for k, v in special.items()},
                   templates=templates, config=config, folder=folder,
                   template_file=template_file)

    @classmethod
    def from_tokenizer(cls, tokenizer: tokenizers.Tokenizer, *, bos_token: str | None = None,
                       eos_token: str | None = None, pad_token: str | None = None,
                       chat_template: str | list[dict] | None = None) -> "Tokenizer":
        """Wrap a `tokenizers.Tokenizer` (it is copied, not changed).

        Behaves as `transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer,
        bos_token=..., ...)` saved and loaded again: the named special tokens are
        registered as special (added to the vocabulary where missing).

        Args:
          tokenizer: the tokenizers pipeline.
          bos_token: the beginning-of-sequence token's text; None (the default) for none.
          eos_token: the end-of-sequence token's text; None (the default) for none.
          pad_token: the padding token's text; None (the default) for none.
          chat_template: a Jinja chat template, or a list of `{"name", "template"}`
            (the one named "default" is used); None (the default) for none.

        Returns:
          The tokenizer.

        Raises:
          TokenizerError: `chat_template` is neither a string nor a list of named templates.
        """
        backend = tokenizers.Tokenizer.from_str(tokenizer.to_str())
        special = {name: value for name, value in (("bos_token", bos_token),
                                                   ("eos_token", eos_token),
                                                   ("pad_token", pad_token)) if value is not None}
        config = {} if chat_template is None else {"chat_template": chat_template}
        templates, _ = config_templates(config, "from_tokenizer(chat_template=...)")
        register_tokens(backend, {}, special, [])
        return cls(backend, special=special, templates=templates, config={},
                   template_file="from_tokenizer(chat_template=...)")

    # ---------------------------------------------------------------- text

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, as `transformers_tokenizer(text, add_special_tokens=...)`.

        Args:
          text: the text; special tokens written in it (e.g. "</s>") become their ids.
          add_special_tokens: let the post-processor add its tokens (e.g. LLaMA's BOS);
            default True.

        Returns:
          The ids, as a list of ints.

        Raises:
          TypeError: `text` is not a `str`.
        """
        return list(self.backend.encode(_str(text), add_special_tokens=add_special_tokens).ids)

    def encode_with_offsets(self, text: str, *, add_special_tokens: bool = False
                            ) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` and, for each, the `(start, end)` characters of `text` it
        came from (tokens the post-processor adds have `(0, 0)`).

        Args:
          text: the text.
          add_special_tokens: as in `encode`, but False by default.

        Returns:
          `(ids, offsets)`: a list of ints and a list of `(start, end)` pairs.

        Raises:
          TypeError: `text` is not a `str`.
        """
        enc = self.backend.encode(_str(text), add_special_tokens=add_special_tokens)
        return list(enc.ids), [tuple(o) for o in enc.offsets]

    def decode(self, ids, *, skip_special_tokens: bool = True) -> str:
        """The text of token ids, as `transformers_tokenizer.decode(ids, ...)`.

        Args:
          ids: token ids: a list, or a numpy or JAX array (flattened).
          skip_special_tokens: leave special tokens (BOS, EOS, padding, ...) out;
            default True.

        Returns:
          The text.
        """
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","),
                                  (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"),
                                  (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(before, after)
        return text

    # ---------------------------------------------------------------- chat

    def apply_chat_template(self, messages: list[dict], *,
                            add_generation_prompt: bool = False) -> str:
        """The conversation as the model's chat template writes it: the text
        `transformers_tokenizer.apply_chat_template(messages, tokenize=False,
        add_generation_prompt=...)` returns.

        Args:
          messages: `[{"role": ..., "content": ...}, ...]`.
          add_generation_prompt: end with the header of an assistant turn (e.g.
            "<|im_start|>assistant\\n"), to generate a reply; default False.

        Returns:
          The rendered text.

        Raises:
          TokenizerError: the tokenizer has no chat template (or only named ones, none
            "default"); the template is not valid Jinja; `messages` is not a non-empty
            list, or a message is not an object with a string "role" and a "content";
            the template refuses a message (its `raise_exception` text and the message's
            index) or fails.
        """
        template = self._compiled_template()
        messages = self._prepare(messages)
        return self._render_checked(template, messages, add_generation_prompt)

    def encode_chat(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        """Token ids of a conversation and which of them are the assistant's.

        The ids are `transformers_tokenizer.apply_chat_template(messages, tokenize=True)`'s:
        the rendered text encoded without extra special tokens (the template writes those).
        The mask is True on the tokens of each assistant message's content and of what the
        template writes after it before the next message (its end-of-turn, e.g.
        "<|im_end|>\\n" or " </s>"), and False on system and user turns and on the headers
        that open assistant turns ("<|im_start|>assistant\\n"), which the model is given,
        not asked to produce.

        An assistant turn is the text the template adds between `messages[:i]` rendered
        with the generation prompt and `messages[:i + 1]`. A template that does not render
        a conversation's start as the start of the whole conversation (it numbers the
        turns, or renders older turns differently) gets a fallback: the turn is the
        message's content found in the whole text, plus the end-of-turn text the template
        writes after it.

        Args:
          messages: `[{"role": ..., "content": ...}, ...]`.

        Returns:
          `(ids, mask)`, two lists of the same length.

        Raises:
          TokenizerError: as `apply_chat_template`; or the fallback cannot find an
            assistant message's content in the rendered conversation.
        """
        template = self._compiled_template()
        messages = self._prepare(messages)
        text = self._render_checked(template, messages, False)
        enc = self.backend.encode(text, add_special_tokens=False)
        spans = self._assistant_spans(template, messages, text)
        return list(enc.ids), assistant_mask(enc.offsets, spans)

    def _assistant_spans(self, template, messages: list[dict], text: str
                         ) -> list[tuple[int, int]]:
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            try:
                before = self._render(template, messages[:i], True)
                through = self._render(template, messages[:i + 1], False)
            except template_errors():
                # A template may refuse a conversation's start (e.g. one that must end
                # with a user turn); the fallback needs only the whole.
                before = through = None
            if (through is not None and text.startswith(through)
                    and through.startswith(before) and len(before) >= cursor):
                span = (len(before), len(through))
            else:
                span = self._find_turn(i, message, through or "", text, cursor)
            spans.append(span)
            cursor = span[1]
        return spans

    def _find_turn(self, i: int, message: dict, through: str, text: str, cursor: int
                   ) -> tuple[int, int]:
        content = message["content"]
        start, needle = -1, ""
        if isinstance(content, str):
            # Verbatim first; templates often strip the content.
            for needle in (content, content.strip()):
                start = text.find(needle, cursor) if needle else -1
                if start >= 0:
                    break
        if start < 0:
            raise TokenizerError(
                f"the chat template of {self._source} does not render the first messages of "
                f"a conversation as the start of the whole conversation, and message {i} "
                f"(assistant) is not found verbatim in the whole, so which tokens are the "
                f"assistant's cannot be told; use the {{\"prompt\", \"completion\"}} data "
                f"format, or a chat template that renders each turn the same wherever it is")
        end = start + len(needle)
        at = through.rfind(needle)
        if at >= 0:
            # The end-of-turn this template writes after the message, as far as the whole
            # conversation has it too (a template may add more after the last message).
            tail = through[at + len(needle):]
            n = 0
            while n < len(tail) and end + n < len(text) and tail[n] == text[end + n]:
                n += 1
            end += n
        return start, end

    def _compiled_template(self):
        if self.chat_template is not None:
            return compile_template(self.chat_template, self._template_file or self._source)
        if self._templates:
            raise TokenizerError(
                f"{self._source} has {len(self._templates)} named chat templates "
                f"({', '.join(sorted(self._templates))}) in {self._template_file} and none is "
                f"named \"default\"; rename the one to use to \"default\"")
        where = ("no \"chat_template\" in tokenizer_config.json and no chat_template.jinja"
                 if self._folder is not None else "none was passed as chat_template=")
        raise TokenizerError(
            f"{self._source} has no chat template ({where}), so it cannot render "
            f"{{\"messages\"}} conversations; use the {{\"prompt\", \"completion\"}} or "
            f"{{\"text\"}} data formats instead, or add the model's chat template")

    def _prepare(self, messages) -> list[dict]:
        """The messages as the template may see them: plain JSON data (a copy, so the
        template cannot reach the caller's objects), keys whose value is None dropped and
        reasoning under all the names templates read, as transformers passes them."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise TokenizerError(f"a conversation must be a non-empty list of "
                                 f"{{\"role\", \"content\"}} messages, got {messages!r:.80}")
        prepared = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or "content" not in message:
                raise TokenizerError(f"message {i} must be an object with a string \"role\" "
                                     f"and a \"content\", got {message!r:.80}")
            message = {k: plain(v) for k, v in message.items() if v is not None}
            reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
            prepared.append(message)
        return prepared

    def _render(self, template, messages: list[dict], add_generation_prompt: bool) -> str:
        # tools and documents are None rather than undefined, as transformers passes them:
        # `tools is not none` must be False.
        return template.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **self._special)

    def _render_checked(self, template, messages: list[dict], add_generation_prompt: bool
                        ) -> str:
        try:
            return self._render(template, messages, add_generation_prompt)
        except template_errors() as error:
            raise self._template_error(template, messages, error) from None

    def _template_error(self, template, messages, error) -> TokenizerError:
        _, raised = jinja()
        # The first conversation start the template rejects names the culprit message.
        culprit = None
        for k in range(1, len(messages) + 1):
            try:
                self._render(template, messages[:k], False)
            except template_errors() as e:
                culprit, error = k - 1, e
                break
        where = ("the conversation" if culprit is None else
                 f"message {culprit} (role {messages[culprit]['role']!r})")
        if isinstance(error, raised):
            return TokenizerError(f"the chat template of {self._source} refused {where}: "
                                  f"{error.message}")
        return TokenizerError(f"the chat template of {self._source} failed on {where}: "
                              f"{type(error).__name__}: {error}")

    # ---------------------------------------------------------------- saving

    def save(self, folder: str | os.PathLike) -> None:
        """Write `tokenizer.json` and `tokenizer_config.json` (special tokens, chat
        template, and the rest of the config this tokenizer was read with) into `folder`,
        so that this class and `transformers.AutoTokenizer` read it back the same.

        A `chat_template.jinja` already in `folder` would take priority over the config in
        transformers 5, so it is rewritten with this tokenizer's template (or removed when
        it has none).

        Args:
          folder: the folder, created if missing.
        """
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        config = copy.deepcopy(self._config)
        for name, value in self._special.items():
            if token_content(config.get(name)) != value:
                config[name] = value
        config["added_tokens_decoder"] = {
            str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                     "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
            for i, t in sorted(self.backend.get_added_tokens_decoder().items())}
        # Known to transformers 4 and 5 (5 maps it to its tokenizers backend).
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        config.pop("chat_template", None)
        if set(self._templates) == {"default"}:
            config["chat_template"] = self.chat_template
        elif self._templates:
            config["chat_template"] = [{"name": n, "template": t}
                                       for n, t in self._templates.items()]
        with open(folder / "tokenizer_config.json", "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False, sort_keys=True)
            f.write("\n")
        stale = folder / "chat_template.jinja"
        if stale.is_file():
            if self.chat_template is not None:
                stale.write_text(self.chat_template, encoding="utf-8")
            else:
                stale.unlink()


def _str(text) -> str:
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return text


claim(globals())  # public names defined in the private modules above live here
