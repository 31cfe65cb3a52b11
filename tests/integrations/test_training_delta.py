"""The training delta (kvj-train-xor/1) goes through the codecs' XOR filter and stores the
bits it always stored: torch's bitwise XOR of the raw bits, as the integer of the element's
size, for every dtype kvj trains with; journals written before the filter took over recover."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvj
from kvj.errors import FormatError
from kvj.integrations.training import StateJournal, recover_training, unxor, xor

INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: What training state is made of: weights and moments in every float width, step counters,
#: RNG states (uint8, int64), masks, complex parameters, fp8 weights.
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.complex64,
          torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn,
          torch.float8_e5m2]


@st.composite
def pairs(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
    nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
    raw = [draw(st.binary(min_size=nbytes, max_size=nbytes)) for _ in range(2)]
    if dtype is torch.bool:  # a bool holds 0 or 1
        raw = [bytes(b & 1 for b in r) for r in raw]
    made = [torch.frombuffer(bytearray(r), dtype=torch.uint8).view(dtype).view(shape) if nbytes
            else torch.empty(shape, dtype=dtype) for r in raw]
    return made[0], made[1]


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@settings(max_examples=300, deadline=None)
@given(pairs())
def test_the_delta_is_torchs_bitwise_xor_of_the_bits_and_undoes_itself(pair):
    a, b = pair
    ints = INT_OF_SIZE[a.element_size()]
    bits = xor(a, b)
    expected = torch.bitwise_xor(a.view(ints), b.view(ints))
    assert bits.dtype == ints and bits.shape == a.shape and _raw(bits) == _raw(expected)
    back = unxor(b, bits)
    assert back.dtype == a.dtype and back.shape == a.shape and _raw(back) == _raw(a)


def test_sizes_and_dtypes_that_do_not_fit_are_refused():
    a = torch.zeros(4)
    with pytest.raises(FormatError):
        xor(a, torch.zeros(5))
    with pytest.raises(FormatError):
        xor(a, torch.zeros(4, dtype=torch.int32))
    with pytest.raises(FormatError):
        unxor(a, torch.zeros(4, dtype=torch.int16))
    with pytest.raises(FormatError):
        unxor(torch.zeros(4, dtype=torch.complex128), torch.zeros(4, dtype=torch.int64))


def _state(step: int) -> dict:
    """A state with every float width, a step counter and a complex stream, made of exact
    arithmetic only (the same bits on any machine), each stream big enough for a segment."""
    x = torch.arange(40_000, dtype=torch.float64) / 40_000 - 0.5 + step * 2.0 ** -20
    return {"w": x.to(torch.float32), "h": x.to(torch.bfloat16), "f": x.to(torch.float16), "d": x * 3,
            "c": torch.complex(x[:20_000], -x[20_000:]).to(torch.complex64),
            "n": torch.arange(20_000, dtype=torch.int64) * (step + 1)}


#: The segment keys kvj stored these saves under at 1bd8330, when the delta was XORed with
#: torch.bitwise_xor in kvj/integrations/training.py: a key is the digest of the segment's
#: dtype, shape, layout and raw bytes, so the same key is the same segment.
WRITTEN_BEFORE = {
    "checkpoint": {
        "s:w.float32": "936ff9c75d082f721360c499bc0262f4383d21466d626b0fce7bfe6cc3b3c007",
        "s:h.bfloat16": "f2fcc9e6fb7645cbf2c44b44abe323c3463fa18b6ad93ed3e863b24c664e5a36",
        "s:f.float16": "c863f81d6efba34afff08020a449f547867db4c414fe689d157e0a103a5b1652",
        "s:d.float64": "e8068b689ae78fbff19dced38655d548004175d8122a61c81eb1ec7233e3f00a",
        "s:c.complex64": "1c9f9dd989fe14c51686c420bfd0c1a54b40e15d2aa6cac46a980c648e8c9ef1",
        "s:n.int64": "f5ed3c93a513815d7ad596cf89189911efb85dca017604c3fba35f3acc330950",
    },
    "delta 1": {
        "s:w.float32": "36bbc942c810742a3521c7ab75acbff2498c25294e965f9cf47ed26ac2905d30",
        "s:h.bfloat16": "a734f1a33308c8a2a67825125d05b31ad27cf099f269f6ab9b090e552884058b",
        "s:f.float16": "1490938030998979e893cac29a3477d3c726b4f18a84525cc0d71b1e6672a081",
        "s:d.float64": "3de6aa6551c8a90b290d23ae40f0d54a7a4e14887ea0a412519aa70a39c5c7eb",
        "s:c.complex64": "eb33d525ee3be5bd3507bd39f0c493a5f1269e0ff7e92d7d020fc083139c3501",
        "s:n.int64": "d270ac4a2e02dec5e485fc0a0a3bd68d6b82cb51bbcdc07d1d248d1feb58b8a5",
    },
    "delta 2": {
        "s:w.float32": "dceed8a7f93c9be44ee841ee4da6bd6c8e84f5aeba770b55b3199668b92dd6f0",
        "s:h.bfloat16": "26b7f18148b4f2b58115ad183d327b0942b19e23293989d7b48d4da98aadfbc1",
        "s:f.float16": "adffedffb80c8f02c556ec3b6f904ea946923c2408cb4a608ee7b198a637da21",
        "s:d.float64": "897fab635515562366a04d5c647fe3a8e4b8264265a0ea5c0431b1fbd11a1d5c",
        "s:c.complex64": "20dfff51d81b4a792c92adb83cff708ecbbc682d85e4bac0d860ab224143fde5",
        "s:n.int64": "47ebb8367a08541f38348a458c62012454404af67c2bf67e0963f6e320828e82",
    },
}


def test_a_journal_stores_the_segments_it_stored_before_and_recovers_from_them(tmp_path):
    path = str(tmp_path / "j")
    with kvj.Journal.open(path) as j, StateJournal(j, full_every=10, model="m") as sj:
        for step in range(3):
            sj.save(step, _state(step))
    state = kvj.replay(path)
    assert [d["meta"]["whole"] for d in state.deltas] == [[], []]  # every stream XORed
    keys = {"checkpoint": state.checkpoint["keys"], **{f"delta {d['step']}": d["keys"] for d in state.deltas}}
    streams = {k: {n: v for n, v in ks.items() if n.startswith("s:")} for k, ks in keys.items()}
    assert streams == WRITTEN_BEFORE
    with kvj.Journal.open(path) as j:
        got = recover_training(state, j.store)
    assert got.step == 2
    for name, t in _state(2).items():
        assert _raw(got.state[name]) == _raw(t), name


def test_a_delta_of_a_16_byte_stream_not_listed_whole_is_a_format_error(tmp_path):
    """A complex128 stream has no XOR: a delta record that does not list it as stored whole
    does not fit the format (it raised a KeyError)."""
    path = str(tmp_path / "j")
    z = torch.complex(torch.arange(8192, dtype=torch.float64), torch.zeros(8192, dtype=torch.float64))
    with kvj.Journal.open(path) as j, StateJournal(j, full_every=10, model="m") as sj:
        for step in range(2):
            sj.save(step, {"z": z + step})
    state = kvj.replay(path)
    (delta,) = state.deltas
    assert delta["meta"]["whole"] == ["z.complex128"]
    forged = {"checkpoint": state.checkpoint, "deltas": [{**delta, "meta": {**delta["meta"], "whole": []}}]}
    with kvj.Journal.open(path) as j, pytest.raises(FormatError, match="does not fit"):
        recover_training(forged, j.store)
