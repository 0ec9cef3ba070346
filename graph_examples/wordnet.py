"""WordNet synset graph parsed from the Princeton database files, with an .npz cache.

Nodes are synsets, keyed by (data file, byte offset): offsets are unique only within
one data.* file, and adjective satellites (ss_type ``s``) live in data.adj. Every
pointer (semantic and lexical, e.g. hypernym ``@``, antonym ``!``, derivation ``+``)
becomes one directed edge from the synset holding it to the target synset; lexical
pointers join words, and we keep them at synset level. Labels are the lexicographer
file numbers (0..44, e.g. 3 = noun.Tops, 29 = verb.body).
"""
import hashlib
import os
import warnings
from pathlib import Path
from typing import NamedTuple, Optional, Union

import numpy as np

from graph_examples.errors import DatasetError, DatasetNotFoundError

DEFAULT_ROOT = "/usr/share/wordnet"
NUM_LEX_FILES = 45
# Names of the 45 lexicographer files, by number (lexnames(5WN)): the class names.
LEX_NAMES = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal",
    "noun.artifact", "noun.attribute", "noun.body", "noun.cognition", "noun.communication",
    "noun.event", "noun.feeling", "noun.food", "noun.group", "noun.location", "noun.motive",
    "noun.object", "noun.person", "noun.phenomenon", "noun.plant", "noun.possession",
    "noun.process", "noun.quantity", "noun.relation", "noun.shape", "noun.state",
    "noun.substance", "noun.time", "verb.body", "verb.change", "verb.cognition",
    "verb.communication", "verb.competition", "verb.consumption", "verb.contact",
    "verb.creation", "verb.emotion", "verb.motion", "verb.perception", "verb.possession",
    "verb.social", "verb.stative", "verb.weather", "adj.ppl")
# Data files in node order, and the pointer pos letters that point into each;
# satellites 's' point into data.adj.
POS_FILES = ("noun", "verb", "adj", "adv")
POS_LETTERS = ("n", "v", "a", "r")
_POS_CODE = {"n": 0, "v": 1, "a": 2, "s": 2, "r": 3}
# Bump when the parse or the cache layout changes, so stale caches are ignored.
_CACHE_FORMAT = 1
_INSTALL_HINT = (
    "install it with `apt-get install wordnet-base` (Debian/Ubuntu) or `make data`, "
    "or pass root=<directory holding data.noun, data.verb, data.adj, data.adv>"
)


class WordNetArrays(NamedTuple):
    """Parsed WordNet: one row per synset, one entry per pointer.

    Attributes:
        pos: int8 (N,) data file of each synset, an index into POS_FILES.
        offset: int64 (N,) byte offset of each synset in its data file.
        labels: int64 (N,) lexicographer file number, 0..44.
        src: int64 (P,) node id holding each pointer.
        dst: int64 (P,) node id each pointer targets.
    """

    pos: np.ndarray
    offset: np.ndarray
    labels: np.ndarray
    src: np.ndarray
    dst: np.ndarray


def data_files(root: Union[str, Path]) -> list:
    """Return the four data.* paths under root, checking that they exist.

    Args:
        root: directory of the WordNet database (Debian: /usr/share/wordnet).

    Returns:
        Paths of data.noun, data.verb, data.adj, data.adv in node order.

    Raises:
        DatasetNotFoundError: a file is missing; the message says how to install it.
    """
    paths = [Path(root) / f"data.{name}" for name in POS_FILES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise DatasetNotFoundError(
            f"WordNet not found: missing {', '.join(missing)}; {_INSTALL_HINT}")
    return paths


def parse_wordnet(root: Union[str, Path] = DEFAULT_ROOT) -> WordNetArrays:
    """Parse the four WordNet data files into node and pointer arrays (no cache).

    Args:
        root: directory holding data.noun, data.verb, data.adj and data.adv.

    Returns:
        WordNetArrays with nodes in file order (noun, verb, adj, adv) and pointers
        in the order they appear.

    Raises:
        DatasetNotFoundError: a data file is missing.
        DatasetError: a line is malformed or a pointer targets an unknown synset.
    """
    paths = data_files(root)
    pos, offset, labels = [], [], []
    ptr_src, ptr_pos, ptr_off = [], [], []
    for code, path in enumerate(paths):
        with open(path, "r", encoding="utf-8", errors="replace") as fh:
            for lineno, line in enumerate(fh, 1):
                # The license header lines start with two spaces.
                if line.startswith("  ") or not line.strip():
                    continue
                try:
                    _parse_line(line, code, len(pos), pos, offset, labels,
                                ptr_src, ptr_pos, ptr_off)
                except (ValueError, IndexError, KeyError) as exc:
                    raise DatasetError(
                        f"{path}:{lineno}: malformed synset line ({exc}): "
                        f"{line[:80]!r}") from exc
    pos_arr = np.asarray(pos, dtype=np.int8)
    off_arr = np.asarray(offset, dtype=np.int64)
    dst = _node_ids(pos_arr, off_arr, np.asarray(ptr_pos, dtype=np.int8),
                    np.asarray(ptr_off, dtype=np.int64), root)
    return WordNetArrays(pos_arr, off_arr, np.asarray(labels, dtype=np.int64),
                         np.asarray(ptr_src, dtype=np.int64), dst)


def _parse_line(line, code, node, pos, offset, labels, ptr_src, ptr_pos, ptr_off):
    # Only the part before the gloss separator holds fields; the gloss is free text.
    fields = line.partition(" | ")[0].split()
    lex = int(fields[1])
    if not 0 <= lex < NUM_LEX_FILES:
        raise ValueError(f"lex_filenum {lex} outside 0..{NUM_LEX_FILES - 1}")
    w_cnt = int(fields[3], 16)  # two hex digits by the wndb(5) format
    at = 4 + 2 * w_cnt
    p_cnt = int(fields[at])
    at += 1
    for _ in range(p_cnt):
        # pointer_symbol synset_offset pos source/target
        ptr_off.append(int(fields[at + 1]))
        ptr_pos.append(_POS_CODE[fields[at + 2]])
        ptr_src.append(node)
        at += 4
    pos.append(code)
    offset.append(int(fields[0]))
    labels.append(lex)


def _node_ids(pos, offset, ptr_pos, ptr_off, root):
    # One int64 key per synset (file code in the high bits) makes the pointer
    # lookup one vectorized searchsorted instead of a dict probe per pointer.
    keys = (pos.astype(np.int64) << 40) | offset
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    ptr_keys = (ptr_pos.astype(np.int64) << 40) | ptr_off
    where = np.searchsorted(sorted_keys, ptr_keys).clip(max=len(keys) - 1)
    found = sorted_keys[where] == ptr_keys
    if not found.all():
        bad = int(np.flatnonzero(~found)[0])
        raise DatasetError(
            f"WordNet at {root}: {int((~found).sum())} pointers target unknown synsets, "
            f"first: offset {int(ptr_off[bad]):08d} in data.{POS_FILES[ptr_pos[bad]]}")
    return order[where]


def cache_path(root: Union[str, Path], cache_dir: Union[str, Path]) -> Path:
    """Return the cache file for root: its name hashes the data files' sizes and mtimes.

    Args:
        root: WordNet directory.
        cache_dir: directory of cache files.

    Returns:
        Path of the .npz cache; a different path whenever a data file changes.

    Raises:
        DatasetNotFoundError: a data file is missing.
    """
    digest = hashlib.sha256(f"format={_CACHE_FORMAT}".encode())
    for path in data_files(root):
        st = path.stat()
        digest.update(f"|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return Path(cache_dir) / f"wordnet-{digest.hexdigest()[:16]}.npz"


def default_cache_dir() -> Path:
    """Return $DISTEMB_CACHE_DIR, else ~/.cache/distemb."""
    env = os.environ.get("DISTEMB_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "distemb"


def load_wordnet_arrays(root: Union[str, Path] = DEFAULT_ROOT,
                        cache_dir: Optional[Union[str, Path]] = None,
                        use_cache: bool = True) -> WordNetArrays:
    """Load parsed WordNet from the cache, parsing and caching it on a miss.

    Args:
        root: directory holding the data.* files.
        cache_dir: where to keep the .npz cache; default: default_cache_dir().
        use_cache: False parses every time and writes nothing.

    Returns:
        WordNetArrays, identical whether read from the cache or parsed.

    Raises:
        DatasetNotFoundError: the data files are missing.
        DatasetError: the data files are malformed.

    Warns:
        RuntimeWarning: the cache could not be written (the parse is still returned).
    """
    if not use_cache:
        return parse_wordnet(root)
    path = cache_path(root, default_cache_dir() if cache_dir is None else cache_dir)
    if path.is_file():
        try:
            with np.load(path) as npz:
                return WordNetArrays(*(npz[f] for f in WordNetArrays._fields))
        except (OSError, KeyError, ValueError):
            pass  # a truncated or foreign cache file: re-parse and overwrite it
    arrays = parse_wordnet(root)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write then rename, so a concurrent reader never sees half a file.
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
        np.savez(tmp, **arrays._asdict())
        os.replace(tmp, path)
    except OSError as exc:
        # A read-only home must not stop the example: it only costs a re-parse.
        warnings.warn(f"WordNet cache not written to {path}: {exc}", RuntimeWarning)
    return arrays


def node_names(arrays: WordNetArrays) -> np.ndarray:
    """Return each synset's id as '<8-digit offset>-<n|v|a|r>', e.g. '00001740-a'."""
    letters = np.asarray(POS_LETTERS)[arrays.pos]
    return np.char.add(np.char.add(np.char.zfill(arrays.offset.astype(str), 8), "-"),
                       letters)
