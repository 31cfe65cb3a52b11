"""The man page is the spec: the constants man/kvj-segment.5 states (sizes, magics, limits,
codec names, dtypes, layout tags) are the ones in the code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvj.integrations import dcp, training
from kvj.segments import kvblock
from kvj.segments import segfile as seg
from kvj.segments.codecs import auto, registry, rowdedup, zstd

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "man" / "kvj-segment.5").read_text()


def section(name: str) -> str:
    return PAGE.split(f".SH {name}\n")[1].split("\n.SH ")[0]


def constant(path: str, name: str) -> object:
    """A module-level constant read from the source, without importing it (vLLM is slow to import)."""
    tree = ast.parse((ROOT / path).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{name} not in {path}")


def test_magics_and_the_fixed_parts():
    (magic,) = re.findall(r"magic: ((?:[0-9A-F]{2} ){7}[0-9A-F]{2})", PAGE)
    assert bytes.fromhex(magic) == seg.MAGIC
    assert 'end magic: "KVJSEGOK"' in PAGE and seg.END_MAGIC == b"KVJSEGOK"
    assert ".SS Preamble (16 bytes)" in PAGE and seg.PREAMBLE.size == 16
    assert ".SS Trailer (16 bytes" in PAGE and seg.TRAILER.size == 16
    assert "format version: 1" in PAGE and seg.VERSION == 1
    assert "A file shorter than 32 bytes" in PAGE


def test_header_limits():
    header = section("HEADER")
    assert "with H above 16 MiB" in PAGE and seg.MAX_HEADER == 16 << 20
    assert "at most 2^36 (64 GiB)" in header and seg.MAX_RAW_SIZE == 1 << 36
    assert "a power of two from 4 KiB to 64 MiB (the\nwriter uses 1 MiB)" in header
    assert (seg.MIN_CHUNK_SIZE, seg.MAX_CHUNK_SIZE, seg.CHUNK_SIZE) == (4 << 10, 64 << 20, 1 << 20)
    assert "Array of at most 64 non-negative integers" in header and seg.MAX_NDIM == 64
    assert "at\nleast raw_len / 32768" in header and seg.MAX_EXPANSION == 32768
    assert "map_stored is at least map_raw / 32768" in section("ROW DEDUP")


def test_dtypes_in_the_order_the_page_lists_them():
    listed = section("HEADER").split(".B dtype\nString: one of ")[1].split(". Element bytes")[0]
    names = [n.strip() for n in listed.replace("\n", " ").split(",")]
    assert names == list(seg.ELEMENTS)


def test_digest():
    digest = section("DIGEST")
    assert '"blake3-tree-v1"' in PAGE and seg.DIGEST_ALG == "blake3-tree-v1"
    assert '"kvj-segment-digest-v1\\\\n"' in digest and seg._DIGEST_DOMAIN == b"kvj-segment-digest-v1\n"
    assert seg.descriptor("uint8", [2], {"b": 0.5, "a": [1e-07, "\u00e9"]}) == \
        b'{"dtype":"uint8","layout":{"a":[1e-07,"\\u00e9"],"b":0.5},"shape":[2]}'


def test_codecs():
    codecs = section("CODECS")
    documented = re.findall(r"^\.B (\w+)$", codecs, re.M)
    assert documented == list(registry.BUILTIN)
    assert "level: \\-7..22" in codecs and "window 2^27" in codecs and zstd.MAX_WINDOW_LOG == 27
    assert "hash log 6, minimum match 7" in codecs
    for bad in ({"level": 23}, {"level": -8}):
        with pytest.raises(seg.FormatError):
            registry.get_codec("zstd", bad)
    assert "u8 planes, then per plane u8 mode (0 raw, 1 zstd frame) and u32 length" in codecs


def test_codec_choice_and_row_dedup():
    choice = section("CODEC CHOICE")
    assert "at most 256 KiB (four\n64 KiB slices)" in choice
    assert auto._SAMPLE_SLICE * auto._SAMPLE_SLICES == 256 << 10 and auto._SAMPLE_SLICES == 4
    assert "at least 1.03" in choice and "at least 1.15" in choice
    assert auto._MIN_GAIN == {auto.Backpressure.NORMAL: 1.03, auto.Backpressure.BUSY: 1.15}
    assert "up to 2 MiB for the next 63" in choice
    assert auto.AutoChoices.SMALL == 2 << 20 and auto.AutoChoices.REUSE - 1 == 63
    dedup = section("ROW DEDUP")
    assert "segments of 2 MiB or more" in dedup and 2 * seg.CHUNK_SIZE == 2 << 20
    assert "at least 64 bytes" in dedup and rowdedup.RowDedup.MIN_ROW_BYTES == 64
    assert "a sample of 1/16 of the\nrows" in dedup


def test_the_layout_tags_are_the_code_s():
    layouts = section("LAYOUTS")
    tags = {
        "KV BLOCKS": [kvblock.FORMAT, constant("kvj/integrations/vllm/resuming.py", "START_FORMAT")],
        "TRAINING STATE": [training.FORMAT, training.FULL_FORMAT, training.DELTA_FORMAT],
        "DCP CHECKPOINTS": [dcp.FORMAT],
    }
    for name, formats in tags.items():
        assert f"format {formats[0]}\t{name}:" in layouts, name
        for fmt in formats:
            assert f'"{fmt}"' in section(name), (name, fmt)
    old = section("KV BLOCKS OF KVJ 0.1.0")
    assert f"format {kvblock.HF_V1}\tKV BLOCKS OF KVJ 0.1.0:" in layouts and f"format {kvblock.HF_V1}\n" in old \
        and f'"{kvblock.HF_V1}"' in old
    assert f"kind {kvblock.PAGED_V1}\tKV BLOCKS OF KVJ 0.1.0:" in layouts and f'kind: "{kvblock.PAGED_V1}"' in old
    train = section("TRAINING STATE")
    assert f'"{training.TREE}"' in train and f'"{training.STREAM_PREFIX}NAME"' in train
    assert "at most 64 KiB" in train and training.INLINE_BYTES == 64 << 10
    assert f'name: "{dcp.METADATA}"' in section("DCP CHECKPOINTS")


def test_the_kv_block_identity_fields_are_the_code_s():
    """The layout's fields, in the page's order, are KVBlockLayout's: its identity, then the rank."""
    page = section("KV BLOCKS")
    body = page.split("The layout is\n.RS\n")[1].split(".RE")[0]
    body = re.sub(r'"[^"]*"', "", body.split("{", 1)[1].rsplit("}", 1)[0])
    fields = [part.split(":")[0].strip() for part in body.split(",")]
    layout = kvblock.KVBlockLayout("m", "bfloat16", 2, 2, 8, 4)
    assert fields == [*layout.identity(), "tp_rank", "pp_rank", "stage"]
    assert list(layout.segment_layout([1] * 5, "ab" * 32)) == [*fields, "token_ids", "chain", "seed"]
    for order in (kvblock.L2NHD, kvblock.LHNC):
        assert f".B {order}\n" in page