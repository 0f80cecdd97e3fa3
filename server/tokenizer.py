"""The router's tokenizer: it counts prompt tokens (policy, context checks) and applies chat templates,
so workers receive token ids. The same tokenizer the workers' engines load for the model, read
without transformers (which imports torch wherever torch is installed): the `tokenizers` library
reads the model's tokenizer.json, jinja2 renders its chat template, as transformers itself does for a
fast tokenizer (tests/test_torch_free_router.py holds the two to the same ids, text and template)."""

from __future__ import annotations

import json
import re
import secrets
from datetime import datetime
from pathlib import Path

from pdserve.settings.models import MODEL_NAMES, smollm2_tokenizer_dir
from pdserve.server.errors import bad_request


def load_tokenizer(model: str, tokenizer: str | None = None):
    source = tokenizer or model
    if source in MODEL_NAMES:
        return FastTokenizer(smollm2_tokenizer_dir())  # tiny and qwen2.5-7b use SmolLM2's tokenizer too
    if Path(source).is_dir():
        if (Path(source) / "tokenizer.json").is_file():
            return FastTokenizer(Path(source))
        from transformers import AutoTokenizer  # a slow (Python) tokenizer: only transformers reads it

        return AutoTokenizer.from_pretrained(source)
    raise ValueError(f"no tokenizer for {source!r}: give one of {', '.join(MODEL_NAMES)} or a local checkpoint "
                     f"directory (--tokenizer DIR when the model directory is not on the router's machine)")


class FastTokenizer:
    """A model folder's tokenizer.json and chat template, behind the few calls of transformers'
    tokenizers the router makes (encode, decode, convert_ids_to_tokens, get_vocab, len,
    apply_chat_template)."""

    is_fast = True

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        self.backend_tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template_file = folder / "chat_template.jinja"
        self.chat_template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        # the special tokens a template may name ({{ bos_token }}), as strings
        self.special_tokens = {k: _content(config[k]) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                               if config.get(k) is not None}
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self._template = None

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        text = self.backend_tokenizer.decode(ids, skip_special_tokens=False)
        return _clean_up(text) if self.clean_up_spaces else text

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = False) -> str:
        assert not tokenize, "the router tokenizes the text itself"
        if self._template is None:
            self._template = _compile(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens)


def _content(token) -> str:
    return token["content"] if isinstance(token, dict) else str(token)


def _clean_up(text: str) -> str:
    """The spaces before punctuation and contractions a decoder leaves (what transformers'
    clean_up_tokenization_spaces removes, for the models whose config asks)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _compile(source: str):
    """A chat template in a sandbox (a template is the model folder's code, run on users' messages),
    with the whitespace rules and helpers chat templates are written for."""
    from jinja2.exceptions import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


SPECIAL_TOKEN_MODES = ("escape", "refuse", "allow")


class PromptEncoder:
    """Prompt text and chat messages to token ids. `special_tokens`: what a special token's text (such as
    <|im_start|>) inside a chat message's content becomes: "escape" (the default) encodes it as plain
    text, so a message cannot open a turn of another role; "refuse": 400; "allow": a real special token,
    as vLLM does (then a user's text can forge a system or assistant turn). A plain completions prompt is
    the client's own whole text: its special tokens are always real."""

    def __init__(self, tokenizer, special_tokens: str = "escape"):
        if special_tokens not in SPECIAL_TOKEN_MODES:
            raise ValueError(f"special tokens in chat: one of {', '.join(SPECIAL_TOKEN_MODES)}, not {special_tokens!r}")
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.max_chars_per_token = max_chars_per_token(tokenizer)
        self.special_tokens = special_tokens
        specials = sorted(special_strings(tokenizer), key=len, reverse=True)
        self._special = re.compile("|".join(map(re.escape, specials))) if specials else None
        self._literal = None  # a copy of the tokenizer that reads special tokens' text as plain text

    def text(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def chat(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
             add_special_tokens: bool = False) -> list[int]:
        """continue_final_message: the text ends with the last message's content (what the template puts
        after it, such as an end-of-turn token, is cut), so the answer continues that message."""
        if not self.tokenizer.chat_template:
            raise bad_request("this model has no chat template; use /v1/completions with a plain prompt",
                              "messages", "no_chat_template")
        forged = self._forged(messages)
        if forged is not None and self.special_tokens == "refuse":
            i, token = forged
            raise bad_request(f"`messages.{i}.content` holds the special token {token!r}, which would act as a chat "
                              f"marker; remove it (this server refuses them: --chat-special-tokens)",
                              f"messages.{i}.content", "special_token_in_message")
        if forged is not None and self.special_tokens == "escape":
            return self._chat_escaped(messages, add_generation_prompt, continue_final_message, add_special_tokens)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)
        if continue_final_message:
            last = messages[-1]["content"]
            at = text.rfind(last) if last else -1
            if at < 0:
                raise bad_request("`continue_final_message` needs a last message with text the chat template keeps",
                                  "continue_final_message")
            text = text[:at + len(last)]
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _forged(self, messages: list[dict]) -> tuple[int, str] | None:
        """The first (message index, special token text) found in a message's content, or None."""
        if self._special is None or self.special_tokens == "allow":
            return None
        for i, m in enumerate(messages):
            found = self._special.search(m["content"])
            if found:
                return i, found.group(0)
        return None

    def _chat_escaped(self, messages: list[dict], add_generation_prompt: bool, continue_final_message: bool,
                      add_special_tokens: bool) -> list[int]:
        """The template rendered around a private mark per message; the template's text encoded as
        usual (its markers real), each message's content encoded with special tokens read as text."""
        nonce = secrets.token_hex(8)
        marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
        text = self.tokenizer.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks)],
                                                  add_generation_prompt=add_generation_prompt, tokenize=False)
        if continue_final_message:
            at = text.rfind(marks[-1])
            if at < 0:
                raise bad_request("`continue_final_message` needs a last message with text the chat template keeps",
                                  "continue_final_message")
            text = text[:at + len(marks[-1])]
        ids, pos = [], 0
        for found in re.finditer(re.escape(f"\ue000{nonce}:") + r"(\d+)\ue001", text):
            ids += self.tokenizer.encode(text[pos:found.start()], add_special_tokens=add_special_tokens and not ids)
            ids += self._encode_literal(messages[int(found.group(1))]["content"])
            pos = found.end()
        if pos == 0:
            raise bad_request("this model's chat template does not show message contents as given, so special tokens "
                              "in them cannot be escaped; remove them", "messages", "special_token_in_message")
        return ids + self.tokenizer.encode(text[pos:], add_special_tokens=False)

    def _encode_literal(self, text: str) -> list[int]:
        if isinstance(self.tokenizer, FastTokenizer):
            if self._literal is None:
                from tokenizers import Tokenizer

                self._literal = Tokenizer.from_str(self.tokenizer.backend_tokenizer.to_str())
                self._literal.encode_special_tokens = True
            return self._literal.encode(text, add_special_tokens=False).ids
        return self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)  # transformers'

    def check_ids(self, ids: list[int], param: str = "prompt") -> list[int]:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"`{param}` token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1})",
                              param, "invalid_token_ids")
        return ids

    def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's vocabulary entry (byte-level BPE spelling, e.g. "Ġthe")."""
        return self.tokenizer.convert_ids_to_tokens(ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def max_chars_per_token(tokenizer) -> int:
    """An upper bound on the characters of text one token stands for: the longest vocabulary entry
    (byte-level BPE spells one byte per character, so a token never covers more characters than its
    entry), times 4 where a normalizer runs first (NFKC and friends can shrink text before it is split)."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    normalized = not tokenizer.is_fast or tokenizer.backend_tokenizer.normalizer is not None
    return max(1, longest) * (4 if normalized else 1)


def special_strings(tokenizer) -> set[str]:
    """The text of every special token (the markers a chat template writes, such as <|im_start|>)."""
    if isinstance(tokenizer, FastTokenizer):
        return {t.content for t in tokenizer.backend_tokenizer.get_added_tokens_decoder().values() if t.special}
    added = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}  # transformers'
    return added | set(tokenizer.all_special_tokens)
