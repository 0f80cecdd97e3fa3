"""The router's tokenizer: it counts prompt tokens (policy, context checks) and applies chat templates,
so workers receive token ids. The same tokenizer the workers' engines load for the model."""

from __future__ import annotations

from pathlib import Path

from server.errors import bad_request
from protocol.models import MODEL_NAMES, load_smollm2_tokenizer


def load_tokenizer(model: str, tokenizer: str | None = None):
    source = tokenizer or model
    if source in MODEL_NAMES:
        return load_smollm2_tokenizer()  # tiny and qwen2.5-7b use SmolLM2's tokenizer too
    if Path(source).is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(source)
    raise ValueError(f"no tokenizer for {source!r}: give one of {', '.join(MODEL_NAMES)} or a local checkpoint "
                     f"directory (--tokenizer DIR when the model directory is not on the router's machine)")


class PromptEncoder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.max_chars_per_token = max_chars_per_token(tokenizer)

    def text(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not self.tokenizer.chat_template:
            raise bad_request("this model has no chat template; use /v1/completions with a plain prompt",
                              "messages", "no_chat_template")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

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
