"""What the data/<name>/prepare.py scripts share: their command line, their one-line errors, the checks and
readers of --data_files (local parquet or JSON-lines documents with a 'text' field: openwebtext,
fineweb_edu), and the character-level corpus writer (stdlib_char, shakespeare_char). Each script ends by
writing manifest.json beside its files (tokens.write_manifest): the fingerprint a run records of its data,
hashed once here so that no launch reads the data to make it.

The token files themselves (their layouts, writers and reader) and the GPT-2 tokenizer are marsgpt/tokens.py's.
"""

import json
import os
import sys

import numpy as np

from marsgpt.files import JSONLineError, json_lines
from marsgpt.tokens import UINT16_IDS, DataError, write_bin, write_manifest, write_meta


def run_prepare(main):
    """Run a prepare script's main(): a DataError becomes one `error: ...` line and exit status 2."""
    try:
        main()
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def add_output_dir(parser, script, outputs):
    """--output_dir, where `outputs` go; by default the folder of `script`, the data/<name>/prepare.py."""
    here = os.path.dirname(os.path.abspath(script))
    parser.add_argument(
        "--output_dir",
        default=here,
        help=f"where {outputs} go (default: data/{os.path.basename(here)}/, beside this script)",
    )


def add_data_files(parser, default):
    """--data_files: local documents instead of the hub; `default` says what happens without them."""
    parser.add_argument(
        "--data_files",
        nargs="+",
        help=f"local .parquet or .jsonl files with a 'text' column, read in the order given; no network is "
        f"touched (default: {default})",
    )


def make_output_dir(path):
    """Create --output_dir (and its parents) unless it exists; a file of that name is a DataError."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise DataError(f"--output_dir: {path} is a file, not a directory; pass a directory")
    os.makedirs(path, exist_ok=True)


# ---------------------------------------------------------------------------------------------------
# --data_files: local parquet or JSON-lines documents with a 'text' field (openwebtext, fineweb_edu).

DATA_FILE_SUFFIXES = (".parquet", ".jsonl", ".json")


def check_data_files(paths):
    """Refuse --data_files that cannot be read as documents, naming the first bad file, before any work;
    returns those that hold at least one document (a loader may choke on an empty file).

    Each must be an existing .parquet or .jsonl (.json) file. A parquet file's footer must parse and hold
    a string 'text' column; a JSON-lines file's first line must be a JSON object with a 'text' string.
    Damage further inside a file is found by the reader, which names the file too.
    """
    for path in paths:
        if os.path.isdir(path):
            raise DataError(f"--data_files: {path} is a directory; pass the files in it, e.g. {path}/*.parquet")
        if not os.path.isfile(path):
            raise DataError(f"--data_files: no such file {path}")
        if not path.endswith(DATA_FILE_SUFFIXES):
            raise DataError(f"--data_files takes .parquet or .jsonl files, got {path}")
    with_documents = []
    for path in paths:
        if path.endswith(".parquet"):
            metadata = parquet_metadata(path)
            check_parquet_schema(path, metadata.schema.to_arrow_schema())
            rows = metadata.num_rows
        else:
            with open(path, "rb") as f:
                rows = next(json_line_texts(path, f), None) is not None
        if rows:
            with_documents.append(path)
    return with_documents


def is_arrow_data_error(error):
    """Whether pyarrow raised `error` because a file's bytes are not what they claim to be: ArrowInvalid (bad
    JSON, no parquet magic bytes, a bad footer) or the errno-less OSError of a corrupt parquet page or thrift
    header -- not an operating-system error such as a full disk or a missing permission (it has an errno)."""
    import pyarrow as pa

    return isinstance(error, pa.ArrowInvalid) or (isinstance(error, OSError) and error.errno is None)


def read_error(name, kind, error):
    """The one-line DataError for a file pyarrow cannot read as `kind` ("parquet", "JSON lines")."""
    detail = " ".join(str(error).split())  # pyarrow's messages may span lines
    return DataError(f"{name} could not be read as {kind} ({detail}); is it a complete {kind} file?")


def parquet_metadata(path):
    """A local parquet file's footer: its schema and row count."""
    import pyarrow.parquet as pq

    try:
        return pq.read_metadata(path)
    except (ValueError, OSError) as e:  # pyarrow's ArrowInvalid is a ValueError
        if not is_arrow_data_error(e):
            raise
        raise read_error(path, "parquet", e) from None


def check_parquet_schema(name, schema):
    """A parquet file's documents are its 'text' column, which must hold strings."""
    import pyarrow as pa

    if "text" not in schema.names:
        raise DataError(f"{name}: no 'text' column (columns: {', '.join(schema.names)})")
    kind = schema.field("text").type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{name}: the 'text' column holds {kind}, not strings")


def json_line_texts(name, file):
    """The 'text' string of each non-blank line of the JSON-lines file `file`, open in binary mode; the first
    line that is not a JSON object with a 'text' string is a DataError naming `name` and the line."""
    try:
        for number, record in json_lines(file):
            yield _document_text(name, number, record)
    except JSONLineError as e:
        what = "not UTF-8 text" if e.reason is None else f"not JSON ({e.reason})"
        raise DataError(f"{name} could not be read as JSON lines: line {e.number} is {what}") from None


def _document_text(name, number, record):
    if not isinstance(record, dict):
        raise DataError(f"{name}: line {number} is a JSON {type(record).__name__}, not an object with a 'text' string")
    if "text" not in record:
        raise DataError(f"{name}: line {number} has no 'text' key (keys: {', '.join(record)})")
    if not isinstance(record["text"], str):
        raise DataError(f"{name}: line {number}'s 'text' is {json.dumps(record['text'])[:40]}, not a string")
    return record["text"]


# ---------------------------------------------------------------------------------------------------
# Character-level corpora (stdlib_char, shakespeare_char).


def write_char_corpus(output_dir, text):
    """A character-level dataset as nanoGPT's shakespeare_char: the sorted set of characters is the
    vocabulary (meta.pkl), and the ids split 90/10 by position into train.bin and val.bin."""
    if not text:
        raise DataError("the text is empty: no character dataset to write")
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    vocab = np.unique(codes)
    if len(vocab) > UINT16_IDS:  # checked before the uint16 cast, which would wrap the ids
        raise DataError(
            f"the text has {len(vocab):,} distinct characters, more than the {UINT16_IDS:,} ids a uint16 "
            f"token file can hold; use a smaller or less varied text, or a tokenizer such as GPT-2's"
        )
    ids = np.searchsorted(vocab, codes).astype(np.uint16)
    split = int(0.9 * len(ids))
    make_output_dir(output_dir)
    write_bin(os.path.join(output_dir, "train.bin"), ids[:split])
    write_bin(os.path.join(output_dir, "val.bin"), ids[split:])
    write_meta(os.path.join(output_dir, "meta.pkl"), [chr(c) for c in vocab])
    write_manifest(output_dir)
    print(
        f"{len(ids):,} characters, vocabulary {len(vocab)}: train {split:,} tokens, "
        f"val {len(ids) - split:,} tokens in {output_dir}"
    )
