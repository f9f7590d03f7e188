"""pockjax.tokenizer against transformers' AutoTokenizer on the same folders.

The folders are made here: a small `tokenizers` BPE trained on a few KB of text, wrapped
in `transformers.PreTrainedTokenizerFast` with its special tokens and chat template, and
saved with `save_pretrained`, as a model folder users download holds them.
"""
import doctest
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import pockjax.tokenizer as tokenizer_module  # noqa: E402
from pockjax.tokenizer import Tokenizer, TokenizerError  # noqa: E402

CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}")

ZEPHYR = """{% for message in messages %}
{% if message['role'] == 'user' %}
{{ '<|user|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'system' %}
{{ '<|system|>\n' + message['content'] + eos_token }}
{% elif message['role'] == 'assistant' %}
{{ '<|assistant|>\n'  + message['content'] + eos_token }}
{% endif %}
{% if loop.last and add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}
{% endfor %}"""

TEXT = """The quick brown fox jumps over the lazy dog. A helpful assistant answers questions.
User: what is the capital of France? Assistant: The capital of France is Paris.
Ünïcödé: café, naïve, façade, Straße, smörgåsbord; 日本語のテキスト, 中文文本, 한국어, emoji 🙂🚀.
日本語で、コーヒー。
Tabs\tand   several   spaces, trailing spaces   \nand blank lines\n\n\nNumbers 0 12 345 6789.
Code: def f(x): return x * 2  # comment; {"json": [1, 2, 3]} <html> &amp; 'quotes' "double".
"""
CORPUS = [TEXT * 3] + [f"Sentence number {i} says hello to the world and to sentence {i + 1}.\n"
                       for i in range(60)]

SAMPLES = [
    "Hello world!",
    "",
    " leading and trailing spaces  ",
    "tabs\tnew\nlines\n\n  indented",
    "Ünïcödé café 日本語 🙂🚀 Straße",
    "special </s> and <s> inside <unk> text",
    "chat <|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "never seen: ÿ Ω ∑ ✓",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Café or tea? 🙂"},
     {"role": "assistant", "content": "Café."},
     {"role": "user", "content": "  And in Japanese?  "},
     {"role": "assistant", "content": " 日本語で、コーヒー。 "}],
    [{"role": "user", "content": "Just a question, no answer yet."}],
]


def _train(kind: str) -> tokenizers.Tokenizer:
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers
    if kind == "bytelevel":  # GPT-2 / Qwen style
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=special,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(CORPUS, trainer)
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        return tok
    # SentencePiece-like: spaces become "▁", newlines stay apart
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split("\n", behavior="isolated"),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    if kind != "llama":
        return tok
    # LLaMA's tokenizer.json: "▁" prefixed by the normalizer, bytes outside the vocabulary
    # as <0xNN> tokens, and a post-processor that adds BOS.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    vocab.update({f"<0x{b:02X}>": len(vocab) + b for b in range(256)})
    spec["model"].update(byte_fallback=True, fuse_unk=True)
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    spec["pre_tokenizer"] = None
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    tok = tokenizers.Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


def _save(backend, folder, **kwargs):
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **kwargs)
    fast.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def backends():
    return {kind: _train(kind) for kind in ("bytelevel", "llama", "plain")}


@pytest.fixture(scope="module")
def folders(backends, tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    out = {
        "qwen": _save(backends["bytelevel"], root / "qwen", eos_token="<|im_end|>",
                      pad_token="<|endoftext|>", chat_template=CHATML),
        "llama": _save(backends["llama"], root / "llama", bos_token="<s>", eos_token="</s>",
                       unk_token="<unk>", chat_template=LLAMA2),
        "zephyr": _save(backends["plain"], root / "zephyr", bos_token="<s>", eos_token="</s>",
                        unk_token="<unk>", chat_template=ZEPHYR),
    }
    # The template inside tokenizer_config.json, as transformers 4 wrote it, instead of
    # the chat_template.jinja transformers 5 writes.
    zephyr = out["zephyr"]
    assert (zephyr / "chat_template.jinja").is_file()
    (zephyr / "chat_template.jinja").unlink()
    _edit_config(zephyr, chat_template=ZEPHYR)
    return out


def _edit_config(folder, **changes):
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _copy(folder, tmp_path, name="copy"):
    return shutil.copytree(folder, tmp_path / name)


def _pair(folder):
    return Tokenizer.from_folder(folder), transformers.AutoTokenizer.from_pretrained(str(folder))


def _covered(text, offsets, mask):
    """The characters of `text` the masked tokens come from (byte-level tokens that split
    a character share its offsets, so positions are collected, not spans joined)."""
    positions = {i for (a, b), m in zip(offsets, mask) if m for i in range(a, b)}
    return "".join(text[i] for i in sorted(positions))


def _hf_chat_ids(hf, messages):
    return hf.apply_chat_template(messages, tokenize=True, return_dict=False)


NAMES = ["qwen", "llama", "zephyr"]


# ------------------------------------------------------------------------ encode / decode

@pytest.mark.parametrize("name", NAMES)
def test_encode_decode_match_transformers(folders, name):
    tok, hf = _pair(folders[name])
    for text in SAMPLES:
        for add in (True, False):
            ids = tok.encode(text, add_special_tokens=add)
            assert ids == hf(text, add_special_tokens=add)["input_ids"], (text, add)
            assert tok.encode_with_offsets(text, add_special_tokens=add)[0] == ids
            for skip in (True, False):
                assert tok.decode(ids, skip_special_tokens=skip) == \
                    hf.decode(ids, skip_special_tokens=skip), (text, skip)
        ids, offsets = tok.encode_with_offsets(text)
        expected = hf(text, add_special_tokens=False, return_offsets_mapping=True)
        assert offsets == [tuple(o) for o in expected["offset_mapping"]]
    assert tok.decode(np.asarray([ids, ids])) == hf.decode(ids + ids, skip_special_tokens=True)


@pytest.mark.parametrize("name", NAMES)
def test_special_tokens_and_vocab_size(folders, name):
    tok, hf = _pair(folders[name])
    assert tok.vocab_size == len(hf)
    for attr in ("bos", "eos", "pad"):
        assert getattr(tok, f"{attr}_token") == getattr(hf, f"{attr}_token")
        assert getattr(tok, f"{attr}_id") == getattr(hf, f"{attr}_token_id")


def test_bos_comes_from_the_post_processor(folders):
    llama, qwen, zephyr = (Tokenizer.from_folder(folders[n]) for n in ("llama", "qwen", "zephyr"))
    assert llama.encode("Hello")[0] == llama.bos_id == 1
    assert llama.encode("Hello", add_special_tokens=False)[0] != 1
    assert llama.encode("Hello")[1:] == llama.encode("Hello", add_special_tokens=False)
    assert qwen.bos_id is None
    assert qwen.encode("Hello") == qwen.encode("Hello", add_special_tokens=False)
    assert zephyr.encode("Hello") == zephyr.encode("Hello", add_special_tokens=False)


def test_add_bos_token_in_config_is_ignored_as_transformers_5_does(folders, tmp_path):
    folder = _copy(folders["zephyr"], tmp_path)
    _edit_config(folder, add_bos_token=True, add_eos_token=True)
    tok, hf = _pair(folder)
    assert tok.encode("Hello world") == hf("Hello world")["input_ids"]
    assert tok.bos_id not in tok.encode("Hello world")


def test_config_special_tokens_missing_from_tokenizer_json(folders, tmp_path):
    """A config's special tokens that tokenizer.json does not list are registered as
    transformers registers them: a new pad token grows the vocabulary, an extra special
    token is matched whole, a token given as an object counts like a string."""
    folder = _copy(folders["zephyr"], tmp_path)
    _edit_config(folder, pad_token="<pad>", additional_special_tokens=["<|user|>"],
                 eos_token={"__type": "AddedToken", "content": "</s>", "lstrip": False,
                            "normalized": False, "rstrip": False, "single_word": False})
    tok, hf = _pair(folder)
    assert tok.vocab_size == len(hf) == Tokenizer.from_folder(folders["zephyr"]).vocab_size + 2
    assert (tok.pad_token, tok.pad_id) == (hf.pad_token, hf.pad_token_id) == ("<pad>",
                                                                              tok.vocab_size - 2)
    assert tok.eos_token == "</s>"
    for text in ["<|user|>\nhi<pad></s>", "x<|user|>y"]:
        assert tok.encode(text) == hf(text)["input_ids"]
        assert tok.decode(tok.encode(text)) == hf.decode(hf(text)["input_ids"],
                                                         skip_special_tokens=True)
    assert tok.encode("<|user|>").count(tok.backend.token_to_id("<|user|>")) == 1


def test_from_tokenizer_matches_the_folder(backends, folders):
    tok = Tokenizer.from_tokenizer(backends["bytelevel"], eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHATML)
    hf = transformers.AutoTokenizer.from_pretrained(str(folders["qwen"]))
    for text in SAMPLES:
        assert tok.encode(text) == hf(text)["input_ids"]
    assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (hf.eos_token_id, hf.pad_token_id, len(hf))
    assert tok.encode_chat(CONVERSATIONS[1])[0] == _hf_chat_ids(hf, CONVERSATIONS[1])
    # The caller's tokenizer is not changed by the special tokens registered in the copy.
    before = backends["plain"].get_vocab_size(with_added_tokens=True)
    Tokenizer.from_tokenizer(backends["plain"], pad_token="<pad>")
    assert backends["plain"].get_vocab_size(with_added_tokens=True) == before


# ------------------------------------------------------------------------ chat templates

@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("generation_prompt", [False, True])
def test_apply_chat_template_matches_transformers(folders, name, generation_prompt):
    tok, hf = _pair(folders[name])
    for messages in CONVERSATIONS:
        text = tok.apply_chat_template(messages, add_generation_prompt=generation_prompt)
        assert text == hf.apply_chat_template(messages, tokenize=False,
                                              add_generation_prompt=generation_prompt)
    if name == "qwen":  # the default system message branch
        assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
        assert text.endswith("<|im_start|>assistant\n") == generation_prompt


# What each template writes for an assistant turn that the model must produce: the
# content and the end of the turn up to the next message.
TURN = {
    "qwen": lambda content: content + "<|im_end|>\n",
    "llama": lambda content: " " + content.strip() + " </s>",
    "zephyr": lambda content: content + "</s>\n",
}


@pytest.mark.parametrize("name", NAMES)
def test_encode_chat_ids_and_assistant_mask(folders, name):
    tok, hf = _pair(folders[name])
    for messages in CONVERSATIONS:
        ids, mask = tok.encode_chat(messages)
        assert ids == _hf_chat_ids(hf, messages)
        assert len(mask) == len(ids)
        text = tok.apply_chat_template(messages)
        _, offsets = tok.encode_with_offsets(text)
        turns = [TURN[name](m["content"]) for m in messages if m["role"] == "assistant"]
        # Exactly the characters of the assistant turns are covered ...
        assert _covered(text, offsets, mask) == "".join(turns)
        # ... and each run of masked tokens decodes to one turn.
        runs, run = [], []
        for i, m in zip(ids, mask):
            if m:
                run.append(i)
            elif run:
                runs.append(run)
                run = []
        runs += [run] if run else []
        decoded = [tok.decode(r, skip_special_tokens=False) for r in runs]
        assert decoded == [hf.decode(r, skip_special_tokens=False) for r in runs]
        if name != "qwen":  # the "▁" decoders drop a run's leading space
            turns = [t.lstrip() for t in turns]
        assert decoded == turns
        assert not any(mask[:len(tok.encode(tok.apply_chat_template(
            messages[:1], add_generation_prompt=True), add_special_tokens=False))])


def test_generation_prompt_is_not_masked(folders):
    tok = Tokenizer.from_folder(folders["qwen"])
    messages = CONVERSATIONS[0]
    ids, mask = tok.encode_chat(messages)
    prompt = tok.encode(tok.apply_chat_template(messages[:1], add_generation_prompt=True),
                        add_special_tokens=False)
    assert ids[:len(prompt)] == prompt
    assert prompt[-3:] == tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert mask == [False] * len(prompt) + [True] * (len(ids) - len(prompt))


def test_named_templates_in_config(folders, tmp_path):
    folder = _copy(folders["qwen"], tmp_path)
    (folder / "chat_template.jinja").unlink()
    named = [{"name": "tool_use", "template": "{{ 'tools' }}"},
             {"name": "default", "template": CHATML}]
    _edit_config(folder, chat_template=named)
    tok, hf = _pair(folder)
    assert tok.chat_template == CHATML
    for messages in CONVERSATIONS:
        assert tok.apply_chat_template(messages, add_generation_prompt=True) == \
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.encode_chat(messages)[0] == _hf_chat_ids(hf, messages)

    _edit_config(folder, chat_template=named[:1] + [{"name": "other", "template": CHATML}])
    tok, hf = _pair(folder)
    with pytest.raises(ValueError, match="no default"):
        hf.apply_chat_template(CONVERSATIONS[0], tokenize=False)
    with pytest.raises(TokenizerError, match=r"2 named chat templates \(other, tool_use\).*"
                                             r"none is named \"default\""):
        tok.apply_chat_template(CONVERSATIONS[0])


def test_jinja_files_take_priority_over_the_config(folders, tmp_path):
    folder = _copy(folders["qwen"], tmp_path)
    _edit_config(folder, chat_template="config template")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("{{ 'tools' }}")
    tok, hf = _pair(folder)
    assert tok.chat_template == CHATML == hf.get_chat_template()
    assert tok.apply_chat_template(CONVERSATIONS[0]) == \
        hf.apply_chat_template(CONVERSATIONS[0], tokenize=False)


def test_template_helpers_render_as_in_transformers(backends, tmp_path):
    """tojson (unicode and HTML characters kept, indent), {% generation %}, loop controls,
    namespace, tools and documents passed as None, special-token variables, reasoning
    fields under their aliases, and keys whose value is None dropped."""
    template = (
        "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}|"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}"
        "{% endif %}{% set ns.n = ns.n + 1 %}{% if m.role == 'assistant' %}{% generation %}"
        "[{{ m.content }}]{% endgeneration %}{% else %}{{ m.content }}{% endif %}{% endfor %}"
        "|{{ ns.n }}|{{ tools is none }}{{ documents is none }}|{{ pad_token }}{{ eos_token }}"
        "|{{ messages[1].reasoning_content }}{{ messages[1].thinking }}"
        "|{{ 'name' in messages[0] }}|{{ strftime_now('%Y') | length }}")
    folder = _save(backends["bytelevel"], tmp_path / "t", eos_token="<|im_end|>",
                   pad_token="<|endoftext|>", chat_template=template)
    messages = [{"role": "user", "content": "<b>café</b> & \"q\"", "name": None},
                {"role": "assistant", "content": "ok", "reasoning": "because"},
                {"role": "user", "content": "cut by break"}]
    tok, hf = _pair(folder)
    text = tok.apply_chat_template(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False)
    assert '"<b>café</b> & \\"q\\""' in text and "[ok]" in text and "|2|TrueTrue|" in text
    assert "|becausebecause|False|4" in text


# ------------------------------------------------------------------------ fallback

def test_template_that_is_not_prefix_stable_falls_back(backends):
    # The header counts the messages, so no conversation start is a start of the whole.
    template = "turns: {{ messages | length }}\n" + CHATML
    tok = Tokenizer.from_tokenizer(backends["bytelevel"], eos_token="<|im_end|>",
                                   chat_template=template)
    messages = CONVERSATIONS[1]
    ids, mask = tok.encode_chat(messages)
    text = tok.apply_chat_template(messages)
    assert ids == tok.encode(text, add_special_tokens=False)
    _, offsets = tok.encode_with_offsets(text)
    assert _covered(text, offsets, mask) == "Café.<|im_end|>\n" + " 日本語で、コーヒー。 <|im_end|>\n"

    # When the content cannot be found either, the error says so and what to do.
    hidden = template.replace("message['content']", "message['content'] | upper")
    tok = Tokenizer.from_tokenizer(backends["bytelevel"], chat_template=hidden)
    with pytest.raises(TokenizerError, match=r"message 2 \(assistant\) is not found verbatim.*"
                                             r"\"prompt\", \"completion\""):
        tok.encode_chat(messages)


# ------------------------------------------------------------------------ errors

def test_missing_tokenizer_json(folders, tmp_path):
    folder = tmp_path / "slow"
    folder.mkdir()
    shutil.copy(folders["llama"] / "tokenizer_config.json", folder)
    (folder / "tokenizer.model").write_bytes(b"sentencepiece")
    with pytest.raises(TokenizerError, match=r"has no tokenizer\.json \(it has only the "
                                             r"slow-tokenizer file\(s\) tokenizer\.model\).*"
                                             r"reads the fast-tokenizer file tokenizer\.json.*"
                                             r"AutoTokenizer\.from_pretrained\(folder\)"
                                             r"\.save_pretrained\(folder\)"):
        Tokenizer.from_folder(folder)
    with pytest.raises(TokenizerError, match="is not a directory"):
        Tokenizer.from_folder(tmp_path / "nowhere")


def test_unreadable_files(folders, tmp_path):
    folder = _copy(folders["qwen"], tmp_path)
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json' is not valid JSON"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(TokenizerError, match=r"\"chat_template\" must be a string or a list"):
        Tokenizer.from_folder(folder)
    (folder / "tokenizer.json").write_text('{"model": 1}')
    with pytest.raises(TokenizerError, match=r"tokenizer\.json' could not be read"):
        Tokenizer.from_folder(folder)


def test_no_chat_template(folders, tmp_path):
    folder = _copy(folders["qwen"], tmp_path)
    (folder / "chat_template.jinja").unlink()
    tok, hf = _pair(folder)
    assert tok.chat_template is None
    with pytest.raises(ValueError):
        hf.apply_chat_template(CONVERSATIONS[0], tokenize=False)
    for call in (tok.apply_chat_template, tok.encode_chat):
        with pytest.raises(TokenizerError, match=r"has no chat template.*use the "
                                                 r"\{\"prompt\", \"completion\"\} or "
                                                 r"\{\"text\"\} data formats instead"):
            call(CONVERSATIONS[0])
    assert tok.encode("still encodes") == hf("still encodes")["input_ids"]


def test_bad_messages(folders):
    tok = Tokenizer.from_folder(folders["qwen"])
    for messages, match in [
            ([{"role": "user", "content": "hi"}, {"role": "assistant"}], "message 1 must be"),
            ([{"content": "hi"}], "message 0 must be"),
            ([{"role": 3, "content": "hi"}], "message 0 must be"),
            (["hi"], "message 0 must be"),
            ([], "non-empty list")]:
        for call in (tok.apply_chat_template, tok.encode_chat):
            with pytest.raises(TokenizerError, match=match):
                call(messages)


def test_template_raise_exception_names_the_message(folders):
    tok, hf = _pair(folders["llama"])
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "assistant", "content": "c"}]
    with pytest.raises(Exception, match="Conversation roles must alternate"):
        hf.apply_chat_template(messages, tokenize=False)
    for call in (tok.apply_chat_template, tok.encode_chat):
        with pytest.raises(TokenizerError, match=r"refused message 2 \(role 'assistant'\): "
                                                 r"Conversation roles must alternate"):
            call(messages)


def test_template_that_fails(backends):
    tok = Tokenizer.from_tokenizer(backends["plain"], chat_template="{% for m in messages %}")
    with pytest.raises(TokenizerError, match="is not valid Jinja"):
        tok.apply_chat_template(CONVERSATIONS[0])
    tok = Tokenizer.from_tokenizer(
        backends["plain"],
        chat_template="{% for m in messages %}{{ m.content + m.missing.field }}{% endfor %}")
    with pytest.raises(TokenizerError, match=r"failed on message 0 \(role 'user'\): "
                                             r"UndefinedError"):
        tok.apply_chat_template(CONVERSATIONS[0])
    tok = Tokenizer.from_tokenizer(backends["plain"],
                                   chat_template="{% for m in messages %}{{ m.content + 1 }}"
                                                 "{% endfor %}")
    with pytest.raises(TokenizerError, match=r"failed on message 0 \(role 'user'\): TypeError"):
        tok.encode_chat(CONVERSATIONS[0])
    # The sandbox still guards the template.
    tok = Tokenizer.from_tokenizer(backends["plain"],
                                   chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(TokenizerError, match="SecurityError|UndefinedError"):
        tok.apply_chat_template(CONVERSATIONS[0])
    tok = Tokenizer.from_tokenizer(backends["plain"],
                                   chat_template="{% set ns = namespace(_x=1) %}")
    with pytest.raises(TokenizerError, match="underscore"):
        tok.apply_chat_template(CONVERSATIONS[0])


# ------------------------------------------------------------------------ saving

@pytest.mark.parametrize("name", ["qwen", "llama"])
def test_save_round_trip(folders, tmp_path, name):
    original = Tokenizer.from_folder(folders[name])
    original.save(tmp_path / "saved")
    tok, hf = _pair(tmp_path / "saved")
    for text in SAMPLES:
        assert tok.encode(text) == hf(text)["input_ids"] == original.encode(text)
    for messages in CONVERSATIONS:
        assert tok.encode_chat(messages) == original.encode_chat(messages)
        assert tok.encode_chat(messages)[0] == _hf_chat_ids(hf, messages)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == \
        (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, len(hf))


def test_save_from_tokenizer(backends, tmp_path):
    folder = tmp_path / "saved"
    folder.mkdir()
    (folder / "chat_template.jinja").write_text("stale")  # would win over the config
    tok = Tokenizer.from_tokenizer(backends["llama"], bos_token="<s>", eos_token="</s>",
                                   chat_template=LLAMA2)
    tok.save(folder)
    assert (folder / "chat_template.jinja").read_text() == LLAMA2
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert json.loads((folder / "tokenizer_config.json").read_text())["chat_template"] == LLAMA2
    for text in SAMPLES:
        assert tok.encode(text) == hf(text)["input_ids"]
    assert tok.apply_chat_template(CONVERSATIONS[1]) == \
        hf.apply_chat_template(CONVERSATIONS[1], tokenize=False)
    assert (hf.bos_token, hf.eos_token) == ("<s>", "</s>")


# ------------------------------------------------------------------------ module

def test_docstring_examples():
    result = doctest.testmod(tokenizer_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_imports_neither_transformers_nor_torch():
    code = ("import sys, pockjax.tokenizer; "
            "print(sorted({'transformers', 'torch', 'jax'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
