"""A pytest plugin for PyG's test files run as a trainer of a distemb job (not PyG's):
at the end of the session the trainer closes its distemb context, saying goodbye to the
job's servers (they exit once every trainer has)."""
import distemb


def pytest_unconfigure(config):
    distemb.shutdown()
