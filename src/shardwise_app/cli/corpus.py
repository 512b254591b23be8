"""A training run's corpus: tokenized once, before the workers start, memory-mapped by each.

Every rank used to read and tokenize the whole ``--data`` corpus into its own
memory, so a corpus of a few GB cost a few GB per rank. Now whoever holds the
run folder's lock (our launcher, or rank 0 under a bare ``torchrun``)
tokenizes it, streaming, into ``<run>/corpus/tokens.bin``, and every rank maps
that file read-only: each rank's memory holds only the pages its windows
touch. A later launch of the run (``--resume``, a restart) finds the file
made from the same files and tokenizer and uses it as it is.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

from .common import UsageError
from .run_config import RunConfig
from .run_folder import CORPUS


def prepare(config: RunConfig, out: Path) -> dict[str, Any]:
    """Tokenize the run's corpus into ``out/corpus``; return what ``config.corpus`` says.

    Called under the run's lock, before the workers start. Raises
    ``UsageError`` (and leaves no token file) when the data cannot be used.
    """
    from ..data import DataError, load_corpus

    cache = out / CORPUS
    existed = cache.exists()
    try:
        corpus = load_corpus(
            config.data,
            min_split_bytes=config.seq_len + 1,
            tokenizer=_tokenizer(config),
            cache=cache,
        )
    except DataError as e:
        if not existed:
            shutil.rmtree(cache, ignore_errors=True)
        raise UsageError(str(e)) from None
    described = corpus.describe()
    if config.resumed_metrics:
        then = _resumed_corpus(Path(config.resumed_metrics).with_name("config.json"))
        if then is not None and then != described["sha256"]:
            print(
                "warning: the data changed since this run started; losses will differ",
                file=sys.stderr,
            )
    return described


def open_corpus(config: RunConfig) -> Any:
    """The run's corpus as ``prepare`` left it, memory-mapped read-only (every rank)."""
    from ..data import DataError, open_tokens

    try:
        return open_tokens(Path(config.out) / CORPUS, min_split_bytes=config.seq_len + 1)
    except DataError as e:
        from .failures import RunFailure

        raise RunFailure(str(e)) from None


def _tokenizer(config: RunConfig) -> Any:
    if not config.hf:
        return None  # the built-in GPT reads bytes
    from ..models import hf

    hf.quiet_transformers()
    return hf.load_tokenizer(config.hf)


def _resumed_corpus(config_file: Path) -> str | None:
    try:
        return json.loads(config_file.read_text())["corpus"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
