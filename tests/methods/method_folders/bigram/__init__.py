"""A test-only trained method, ``bigram``: a table of next-token counts learnt from the target's own
continuations. It exists to show that a trained method is one folder: its drafter, network,
training recipe and export format are found by module name once this folder's parent directory
joins ``specwise.methods.__path__`` (tests/methods/test_method_folders.py)."""
