"""kvj flush: which tensor becomes which block, and input that does not fit a request refused
before anything is stored."""

from __future__ import annotations

import pytest
import torch
from support.cli_helpers import assert_fails, in_process, kvj, ndjson

import kvj as kvj_lib

USAGE, DATAERR = 64, 65


def blk(i: int, tokens: int = 16, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.full((2, tokens, 2, 8), float(i)).to(dtype)


@pytest.fixture
def journal(tmp_path):
    path = tmp_path / "j"
    with kvj_lib.Journal.open(path) as j:
        j.start("r")
    return path


@pytest.fixture
def cli(capsys):
    """Run kvj in this process (the console script's code path, without starting torch again)."""
    return lambda *args: in_process(capsys, *args)


def stored(journal) -> set:
    segments = journal / "segments" / "objects"
    return {p.name for p in segments.rglob("*.kvjseg")} if segments.exists() else set()


def test_blocks_go_in_natural_order_and_each_line_names_its_tensor(tmp_path, journal):
    from safetensors.torch import save_file

    save_file({f"blk{i}": blk(i) for i in range(12)}, str(tmp_path / "blocks.safetensors"))
    proc = kvj("flush", tmp_path / "blocks.safetensors", "-j", journal, "-r", "r", "--block-tokens", "16")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[2].startswith("blk2 -> segment 2, tokens 32..48: ")
    assert lines[10].startswith("blk10 -> segment 10, tokens 160..176: ")
    state = kvj_lib.replay(str(journal))
    from kvj.segments.store import SegmentStore

    with SegmentStore(journal / "segments") as store:
        for seg, ref in state.requests["r"].segments.items():
            assert ref.tokens == (16 * seg, 16 * seg + 16)
            assert torch.equal(store.get(ref.key), blk(seg))  # block i holds tokens 16i..16i+16


def test_explicit_order(tmp_path, journal, cli):
    torch.save({"b": blk(1), "a": blk(0), "c": blk(2)}, tmp_path / "x.pt")
    proc = cli("flush", tmp_path / "x.pt", "-j", journal, "-r", "r", "--block-tokens", "16", "--order", "c,a,b",
               "--json")
    assert proc.returncode == 0, proc.stderr
    assert [(r["name"], r["tokens"]) for r in ndjson(proc.stdout)] == [("c", [0, 16]), ("a", [16, 32]),
                                                                        ("b", [32, 48])]
    for bad in ("a,b", "a,b,c,d", "a,a,b", "a,b,c,c"):
        assert_fails(cli("flush", tmp_path / "x.pt", "-j", journal, "-r", "r", "--block-tokens", "16",
                         "--order", bad), USAGE, "--order must name each tensor exactly once")




@pytest.mark.parametrize("case", ["overlap", "start-overlap", "gap-after-start", "gap-with-tokens", "block-tokens",
                                  "token-dim", "layout", "dtype", "shape", "empty", "mixed-shapes"])
def test_inconsistent_input_is_refused_before_anything_is_stored(tmp_path, journal, cli, case):
    def _flush(journal, path, *args):
        return cli("flush", path, "-j", journal, "-r", "r", *args)

    torch.save([blk(0), blk(1)], tmp_path / "first.pt")
    assert _flush(journal, tmp_path / "first.pt", "--block-tokens", "16", "--layout", "model=tiny").returncode == 0
    one = tmp_path / "one.pt"
    torch.save(blk(7), one)
    args = {
        "overlap": ("--tokens", "16:32", "--layout", "model=tiny"),
        "start-overlap": ("--block-tokens", "16", "--start", "16", "--layout", "model=tiny"),
        "gap-after-start": ("--block-tokens", "16", "--start", "48", "--layout", "model=tiny"),
        "gap-with-tokens": ("--tokens", "48:64", "--layout", "model=tiny"),
        "block-tokens": ("--block-tokens", "32", "--layout", "model=tiny"),
        "token-dim": ("--block-tokens", "16", "--token-dim", "0", "--layout", "model=tiny"),
        "layout": ("--block-tokens", "16", "--layout", "model=other"),
        "dtype": ("--block-tokens", "16", "--layout", "model=tiny"),
        "shape": ("--block-tokens", "16", "--layout", "model=tiny"),
        "empty": ("--block-tokens", "16", "--layout", "model=tiny"),
        "mixed-shapes": ("--block-tokens", "16", "--layout", "model=tiny"),
    }[case]
    if case == "dtype":
        torch.save(blk(7, dtype=torch.float32), one)
    elif case == "shape":
        torch.save(torch.zeros(2, 16, 4, 8, dtype=torch.bfloat16), one)
    elif case == "empty":
        torch.save(torch.zeros(2, 0, 2, 8, dtype=torch.bfloat16), one)
    elif case == "mixed-shapes":
        torch.save([blk(2), torch.zeros(2, 16, 2, 4, dtype=torch.bfloat16)], one)
    needle = {"overlap": "overlap segment 1 (tokens 16..32)", "start-overlap": "overlap segment 1",
              "gap-after-start": "tokens 32..48 of request r would not be covered",
              "gap-with-tokens": "tokens 32..48 of request r would not be covered",
              "block-tokens": "no dimension of 32 tokens", "token-dim": "its dimension 0 is not 16 tokens",
              "layout": "a request's layout cannot change", "dtype": "share dtype and shape",
              "shape": "share dtype and shape", "empty": "empty tensor",
              "mixed-shapes": "share dtype and shape"}[case]
    segments, records = stored(journal), kvj_lib.replay(str(journal)).last_lsn
    assert_fails(_flush(journal, one, *args), USAGE, needle)
    assert stored(journal) == segments and kvj_lib.replay(str(journal)).last_lsn == records


def test_replacing_a_segment_with_its_own_range_is_allowed(tmp_path, journal, cli):
    def _flush(journal, path, *args):
        return cli("flush", path, "-j", journal, "-r", "r", *args)

    torch.save([blk(0), blk(1)], tmp_path / "first.pt")
    assert _flush(journal, tmp_path / "first.pt", "--block-tokens", "16").returncode == 0
    torch.save(blk(5), tmp_path / "again.pt")
    proc = _flush(journal, tmp_path / "again.pt", "--tokens", "16:32", "--segment", "1")
    assert proc.returncode == 0, proc.stderr
    assert kvj_lib.replay(str(journal)).requests["r"].resume_position == 32


def test_a_refused_pt_file_is_one_kvj_line(tmp_path, journal):
    import collections

    torch.save({"w": torch.ones(2), "bad": collections.OrderedDict(a=1).keys}, tmp_path / "bad.pt")
    line = assert_fails(kvj("flush", tmp_path / "bad.pt", "-j", journal, "--checkpoint", "1"), DATAERR,
                        "refused: kvj reads .pt files with weights_only=True")
    assert "weights_only=False" not in line and "Warning" not in line


@pytest.mark.parametrize("mode", [("--checkpoint", "5"), ("-r", "r", "--block-tokens", "16")],
                         ids=["checkpoint", "request"])
def test_files_holding_no_tensor_are_refused(tmp_path, journal, cli, mode):
    """Regression: --checkpoint journaled an empty checkpoint, which replaced the training state
    the journal held; --request failed with an internal error (status 70)."""
    from safetensors.torch import save_file

    torch.save({"w": blk(0)}, tmp_path / "w.pt")
    assert cli("flush", tmp_path / "w.pt", "-j", journal, "--checkpoint", "3").returncode == 0
    save_file({}, str(tmp_path / "empty.safetensors"))
    records = kvj_lib.replay(str(journal)).last_lsn
    assert_fails(cli("flush", tmp_path / "empty.safetensors", "-j", journal, *mode), USAGE,
                 "the files hold no tensor: nothing to flush")
    state = kvj_lib.replay(str(journal))
    assert state.last_lsn == records and state.checkpoint["step"] == 3 and list(state.checkpoint["keys"]) == ["w"]
