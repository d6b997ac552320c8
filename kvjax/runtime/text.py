"""Prompts and stops as text and token ids, for ``kvjax.generate`` and the server alike: a prompt (string, chat
messages or ids) encoded and checked, the ids that end a generation, and where a stop string cuts the output."""

from __future__ import annotations

from kvjax import validate


def encode_prompt(model, prompt, chat: bool, name: str = "prompt") -> list[int]:
    """A prompt (a string, or token ids) as checked token ids; errors name it ``name``."""
    if isinstance(prompt, str):
        tok = model.tokenizer
        if tok is None:
            raise ValueError(f"{name} is a string, but this model has no tokenizer: pass lists of token ids")
        validate.unicode_text(name, prompt)  # the tokenizer's own error for a lone surrogate names nothing
        if chat:
            ids = chat_ids(tok, [{"role": "user", "content": prompt}])
        else:
            ids = tok(prompt, add_special_tokens=True)["input_ids"]
        return validate.token_ids(name, list(ids), model.config.vocab_size)
    return validate.token_ids(name, prompt, model.config.vocab_size)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of chat ``messages`` through the tokenizer's chat template, ready for the assistant's turn; a
    message's text that is not valid Unicode (a lone surrogate) is a ``ValueError`` naming the message."""
    for i, message in enumerate(messages):
        for key, value in message.items() if isinstance(message, dict) else ():
            if isinstance(value, str):
                validate.unicode_text(f"message {i}'s {key}", value)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def eos_ids(model) -> set[int]:
    """The token ids that end a generation: the config's EOS ids and the tokenizer's."""
    ids = set(model.config.eos_token_ids)
    if model.tokenizer is not None and model.tokenizer.eos_token_id is not None:
        ids.add(model.tokenizer.eos_token_id)
    return ids


def cut_at_stop(text: str, stop_texts) -> str:
    """``text`` up to the first stop string in it (all of it without one)."""
    cuts = [text.index(s) for s in stop_texts if s in text]
    return text[: min(cuts)] if cuts else text


def stopped(model, tokens, stop_ids, stop_texts) -> bool:
    """The last token is a stop id, or a stop string ends in the text of the last tokens.

    Every token decodes to at least one byte, so a stop string of n UTF-8 bytes lies within the last n + 1
    tokens (one more for a token that starts before it)."""
    if tokens[-1] in stop_ids:
        return True
    if stop_texts:
        window = max(len(s.encode("utf-8")) for s in stop_texts) + 2
        text = model.tokenizer.decode(tokens[-window:], skip_special_tokens=True)
        return any(s in text for s in stop_texts)
    return False
