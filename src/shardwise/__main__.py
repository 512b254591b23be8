"""``python -m shardwise``: the ``shardwise`` command, which lives in ``shardwise_app``.

Only running it loads the application (``pip install 'shardwise[cli]'``);
``import shardwise`` never imports this file.
"""

if __name__ == "__main__":
    from shardwise_app.cli.main import run_as_module

    run_as_module()
