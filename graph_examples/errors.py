"""Exception types raised by the example datasets and pipelines."""


class DatasetError(ValueError):
    """A dataset argument or input file is malformed.

    Example:
        >>> raise DatasetError("edges.txt:3: expected 2 fields `src dst`, got 1: '7'")
    """


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's source files are not installed; the message says how to get them.

    Example:
        >>> raise DatasetNotFoundError("WordNet not found ...: apt-get install wordnet-base")
    """
