"""shardwise_app: the ``shardwise`` command, an application built on the shardwise library.

The library (``import shardwise``) needs torch alone and imports nothing from
here; this package is what ``pip install 'shardwise[cli]'`` adds, with rich
(progress) and matplotlib (plots):

- ``cli/``: the command line. ``main.py`` is the entry (the commands),
  ``common.py`` what they share (bad input, where workers run),
  ``launcher.py`` starts and watches the workers (signals, restarts, a hung
  worker), ``__main__.py`` is the module every worker process starts in
  (``worker.py``: what it does to itself), ``process_group.py`` joins the
  process group, ``signals.py`` how a worker stops, ``failures.py`` and
  ``run_folder.py`` what a run leaves on disk, and one module per command:
  ``train.py`` (its settings, ``RunConfig``, in ``run_config.py``; its flags
  and their checks in ``train_config.py``, whether a run can work here in
  ``fits.py``; the worker's loop in ``train_loop.py``; ``finetune.py`` for
  ``--hf``; ``corpus.py``, the corpus tokenized once for every rank), ``sample.py``, ``export.py`` (their shared
  frame: ``checkpoint_command.py``); ``report.py`` is a training run's
  progress, metrics and plots.
- ``bench/``: ``shardwise bench``, the bare model, torch's FSDP2 and shardwise
  side by side (``command.py``; its parts: ``models.py``, ``jobs.py``,
  ``memory.py``, ``tables.py``).
- ``models/``: the built-in GPT (``gpt.py``) and transformers models from disk
  (``hf.py``, ``hf_export.py``).
- ``data.py``: the training text, its memory-mapped token file, and its batches.
- ``extras.py``: the optional packages, found without importing them.

Nothing is imported here: a worker (``python -m shardwise_app.cli``)
sets up its signals before anything heavy is loaded.
"""
