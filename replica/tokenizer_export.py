"""Write the engine's tokenizer as an HF tokenizer folder (tokenizer.json + tokenizer_config).

Clients that tokenize on their side (lm-eval's `local-completions` in its default tokenized
mode, benchmark clients) load it with `transformers.AutoTokenizer.from_pretrained(folder)`
and produce exactly the ids the server would: the same `tokenizers` model, normaliser,
pre-tokenizer, post-processor (BOS) and decoder, whatever the served model was read from.
"""

from __future__ import annotations

import json
from pathlib import Path

from iterserve.replica.tokenizer import Tokenizer


def export_tokenizer(tokenizer: Tokenizer, folder: str | Path,
                     model_max_length: int | None = None) -> Path:
    """Write tokenizer.json and tokenizer_config.json into `folder` (created); returns it."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(out / "tokenizer.json"))
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        # The post-processor in tokenizer.json already adds BOS where the model wants it.
        "clean_up_tokenization_spaces": False,
    }
    if tokenizer.bos_token is not None:
        config["bos_token"] = tokenizer.bos_token
    if tokenizer.eos_token is not None:
        config["eos_token"] = tokenizer.eos_token
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False),
                                               encoding="utf-8")
    return out
