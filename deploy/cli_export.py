"""`iterserve export-tokenizer DIR [--model PATH]`: the served model's tokenizer as an HF
folder, for clients that tokenize on their side (lm-eval `local-completions`)."""

from __future__ import annotations

import argparse


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="iterserve export-tokenizer",
        description="Write the served model's tokenizer (tokenizer.json + "
                    "tokenizer_config.json) into DIR, loadable by "
                    "transformers.AutoTokenizer.from_pretrained(DIR).")
    parser.add_argument("folder", metavar="DIR", help="output folder (created)")
    parser.add_argument("--model", default=None,
                        help="model path as given to `iterserve serve` (default: built-in)")
    args = parser.parse_args(argv)
    from iterserve.deploy.engine_client import load_tokenizer
    from iterserve.replica.tokenizer_export import export_tokenizer

    out = export_tokenizer(load_tokenizer(args.model), args.folder)
    print(f"wrote {out / 'tokenizer.json'} and {out / 'tokenizer_config.json'}")
    return 0
