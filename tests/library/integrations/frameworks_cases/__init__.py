"""Cases of tests/library/integrations/test_frameworks.py, one module per framework.

Each module imports its framework inside ``setup()`` only, so the worker can
call ``shardwise.patch_fsdp2()`` first, as docs/frameworks.md tells users to.
"""
