"""The chain of saves in a checkpoint directory: one full save, then incremental ones.

``opt.save(path)`` writes a full save; ``opt.save(path, incremental=True)`` after it
writes a *delta*: only the rows changed since the save before it, and the keys removed
or evicted since (:mod:`~distemb.kvstore.checkpoint.snapshot`'s records). The directory's
``manifest.json`` is always the newest save, the *head*: its ``parent`` names the save
before it (None for a full save) and its ``links`` every earlier save of the chain, the
full save first; each earlier save's manifest is kept, as it was, as
``link-<save id>.json``. A delta becomes the head as a full save does, by one rename of
``manifest.json``, written last and fsynced: a save that dies before it leaves the
previous chain whole, and only files no manifest names, which the next save removes.

Reading the chain checks every link before a row is read: each one present, each
naming the one before it as its parent, in the order the head lists them. A load then
takes each key's row from the newest save that wrote it, unless a later one removed it
(:func:`chain_entry`).

Example:
    >>> import tempfile
    >>> d = tempfile.mkdtemp()
    >>> write_manifest(d, {"format": "distemb-checkpoint", "version": 4,
    ...                    "save_id": "aaaa0000", "parent": None, "links": [], "tensors": {}})
    >>> [m["save_id"] for m in read_chain(d)]
    ['aaaa0000']
    >>> write_manifest(d, read_chain(d)[0], link_file("aaaa0000"))
    >>> write_manifest(d, {"format": "distemb-checkpoint", "version": 4, "save_id": "bbbb1111",
    ...                    "parent": "aaaa0000", "links": ["aaaa0000"], "tensors": {}})
    >>> [m["save_id"] for m in read_chain(d)]
    ['aaaa0000', 'bbbb1111']
"""
import json
import os

from distemb.errors import KVStoreError
from distemb.kvstore.checkpoint.segments import SAVE_ID, SEGMENT_FILE
from distemb.kvstore.checkpoint.manifest import MANIFEST, read_manifest, table_entry
from distemb.kvstore.checkpoint.snapshot import entry_files
from distemb.rules import state_owner


def link_file(save_id: str) -> str:
    """The file keeping the manifest of save ``save_id`` once a later save is the head."""
    return f"link-{save_id}.json"


def _label(k: int) -> str:
    return "the full save" if k == 0 else f"delta {k}"


def read_chain(directory: str) -> list:
    """The manifests of the saves of checkpoint ``directory``, the full save first and
    the head (``manifest.json``) last, every link checked.

    Raises:
        KVStoreError: no manifest, a link missing (naming it and its place), a link
            holding another save, or links out of order (one whose parent is not the
            save before it).
    """
    head = read_manifest(directory)
    ids = head.get("links") or []
    if not isinstance(ids, list) or not all(isinstance(i, str) and SAVE_ID.match(i)
                                            for i in ids):
        raise KVStoreError(f"{directory}: {MANIFEST} lists malformed links "
                           f"({str(ids)[:80]}); expected the ids of earlier saves")
    chain, files = [], [link_file(i) for i in ids] + [MANIFEST]
    for k, sid in enumerate(ids):
        if not os.path.isfile(os.path.join(directory, files[k])):
            raise KVStoreError(f"{directory}: {_label(k)} of the chain (save {sid}) is "
                               f"missing: no {files[k]}; the saves after it cannot be "
                               "replayed without it")
        chain.append(read_manifest(directory, files[k]))
    chain.append(head)
    ids = ids + [head.get("save_id")]
    for k, m in enumerate(chain):
        if m.get("save_id") != ids[k]:
            raise KVStoreError(f"{directory}: {files[k]} holds save {m.get('save_id')!r:.40}, "
                               f"the chain has save {ids[k]} there")
        parent, want = m.get("parent"), (ids[k - 1] if k else None)
        if parent != want or (m.get("links") or []) != ids[:k]:
            before = f"{_label(k - 1)} is save {want}" if k else "it is the first"
            raise KVStoreError(f"{directory}: {_label(k)} ({files[k]}, save {ids[k]}) "
                               f"follows save {parent!r:.40}, but {before}: the saves are "
                               "out of order (or from another chain)")
    return chain


def chain_entry(chain: list, name: str, directory: str) -> dict:
    """The entry of table ``name`` over a chain (:func:`read_chain`): the full save's
    records in ``"shards"``, each delta's in ``"deltas"`` (oldest first), the head's id
    in ``"save_id"``; what :func:`~distemb.kvstore.checkpoint.snapshot.load_shard` loads.

    Raises:
        KVStoreError: a save of the chain lacks the table, or holds it with other rows.
    """
    entries = []
    for k, m in enumerate(chain):
        try:
            entries.append(table_entry(m, name, directory))
        except KVStoreError as e:
            if k == 0:
                raise
            raise KVStoreError(f"{directory}: {_label(k)} of the chain (save "
                               f"{m.get('save_id')}) has no table {name!r}: {e}") from None
    base = entries[0]
    for k, e in enumerate(entries[1:], 1):
        if (e.get("shape"), e.get("dtype")) != (base.get("shape"), base.get("dtype")):
            raise KVStoreError(f"{directory}: table {name!r} has rows {e.get('shape')} "
                               f"{e.get('dtype')} in {_label(k)}, {base.get('shape')} "
                               f"{base.get('dtype')} in the full save")
    return dict(base, deltas=[e.get("shards") for e in entries[1:]],
                save_id=chain[-1].get("save_id"))


def manifest_files(manifest: dict, directory: str) -> set:
    """The segment files of every table of a manifest (of any version)."""
    out = set()
    for name in {state_owner(n) or n for n in manifest.get("tensors", {})}:
        try:
            out.update(entry_files(table_entry(manifest, name, directory)))
        except KVStoreError:
            continue  # a malformed entry names no file to keep
    return out


def remove_unreferenced(directory: str, chain: list) -> None:
    """Delete the segment and link files no save of ``chain`` names (earlier chains,
    saves that died), and leftover temporary files."""
    keep = {link_file(m.get("save_id")) for m in chain[:-1]}
    for m in chain:
        keep |= manifest_files(m, directory)
    for name in os.listdir(directory):
        base = name[:-4] if name.endswith(".tmp") else name
        ours = SEGMENT_FILE.match(base) or (name.startswith("link-") and
                                            name.endswith((".json", ".tmp")))
        if ours and name not in keep:
            try:
                os.remove(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: str, manifest: dict, file: str = MANIFEST) -> None:
    """Write ``manifest`` as ``file`` of ``directory`` at once: to a temporary file,
    fsynced, renamed over it, the directory fsynced."""
    final = os.path.join(directory, file)
    tmp = f"{final}.tmp-{os.getpid()}" if file == MANIFEST else f"{final}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(manifest, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(directory)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
