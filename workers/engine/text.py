"""The engine's text side: prompts into token ids, generated ids into text, and where a request stops.

Apart from the step because it is the tokenizer's work, not the model's: it touches no tensor.
    ModelText(tokenizer, eos_token_ids, max_model_len)
    encode_prompt(prompt, chat=False) -> ids     a plain prompt, or one user message through the chat template
    encode_chat(messages) -> ids                 messages through the model's chat template
    text_and_stop(req, token) -> (delta, reason) the newest token's text, and why the request stops there
                                                 (eos, a stop token or string, max_tokens, the context; None:
                                                 it goes on); req.text grows by delta
    detokenize(req) -> delta                     the newest token's text alone (no stop checks)
"""

from __future__ import annotations

from pdserve.workers.engine.request import Request


class ModelText:
    def __init__(self, tokenizer, eos_token_ids: set[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def encode_prompt(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            return self.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def text_and_stop(self, req: Request, token: int) -> tuple[str, str | None]:
        """The text the newest token adds, and why the request stops here (None: it goes on)."""
        p = req.params
        reason = None
        early = len(req.output_ids) < p.min_tokens  # vLLM: no stop checks until min_tokens are generated
        if not early and (token in self.eos_token_ids and not p.ignore_eos or token in p.stop_token_ids):
            reason = "stop"
        delta = self.detokenize(req)
        if reason is None and p.stop and not early:
            hit = min((i for i in (req.text.find(s) for s in p.stop) if i >= 0), default=-1)
            if hit >= 0:
                before = len(req.text) - len(delta)
                hit += max(len(s) for s in p.stop if req.text.startswith(s, hit)) if p.include_stop_str_in_output else 0
                req.text = req.text[:hit]
                delta = req.text[before:] if hit > before else ""
                reason = "stop"
        if reason is None and (len(req.output_ids) >= p.max_tokens or req.num_tokens > self.max_model_len):
            reason = "length"
        return delta, reason

    def detokenize(self, req: Request) -> str:
        """The text the newest token adds, decoding only a few tokens of context each time
        (a token's text can depend on its neighbours, e.g. a leading space or a split
        UTF-8 character, which shows as U+FFFD until the next token completes it)."""
        ids = req.output_ids
        decode = self.tokenizer.decode
        skip = req.params.skip_special_tokens
        before = decode(ids[req.prefix_offset:req.read_offset], skip_special_tokens=skip)
        after = decode(ids[req.prefix_offset:], skip_special_tokens=skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        req.prefix_offset, req.read_offset = req.read_offset, len(ids)
        req.text += delta
        return delta
