"""distemb's own (not DGL's): every Python process of tests/test_dgl_upstream.py loads
this (it is first on their PYTHONPATH) and so writes distemb's INFO log to stderr, where
the test reads which distemb servers started and which trainers joined."""
import logging
import sys

_handler = logging.StreamHandler(sys.stderr)
_handler.setFormatter(logging.Formatter("distemb-log: %(message)s"))
logging.getLogger("distemb").addHandler(_handler)
logging.getLogger("distemb").setLevel(logging.INFO)
