"""kvj's GPU check: one prepared command that runs kvj's CUDA paths on a GPU and says PASS or FAIL.

    python3 scripts/gpu_check.py --out DIR               a GPU machine (sized for one H200; the whole
                                                         run is bounded by --budget, 450 s by default)
    python3 scripts/gpu_check.py --standin --out DIR     a CPU: the same checks, small, under the
                                                         strict CUDA stand-in (tests/support/fakecuda.py)

Checks, in order (each prints PASS or FAIL with its reason, per part; each is timed and bounded:
one that outlives its limit is killed, with its Python stacks on stderr, and the rest go on;
the fast ones that a first run must report come first):

environment    GPU, driver, torch, CUDA, the Python packages found; calibrates torch.cuda._sleep.
bandwidth      GB/s device-to-host and host-to-device through kvj against plain ``tensor.cpu()`` /
               ``.cuda()`` and pinned non-blocking ``copy_``, each result checked; a load of at least
               4 GiB of KV blocks by the vLLM connector's worker (read, checked, copied in by chunks
               through its bounded staging) against pinned ``copy_`` of the same bytes; the worker's
               flush GB/s (gathered, written, fsynced); host time per Flusher.submit.
device         kvj.segments.device's download, upload, gather and scatter, the flusher's downloads,
               load.load / load_many / restore_paged, on NHD-permuted caches
               (``torch.empty(nb, N, H, C).permute(0, 2, 1, 3)``) under a non-default current stream.
               Races are made deterministic with ``torch.cuda._sleep`` (about 20 ms): before each
               producer (so a copy that does not wait for it reads stale bytes) and, on the other
               stream, before each overwrite or reuse (so an overwrite that does not wait for the
               copy lands first). Each part fails if one of kvj's waits is missing.
vllm-blocks    The vLLM connector's device work on caches shaped as vLLM 0.32 allocates them with
               FlashAttention for a ~1B Llama (16 layers, 8 KV heads, head 128, block 16: per layer
               [blocks, 8, 16, 256], an NHD-permuted view), then as vLLM 0.33+ builds them (one int8
               allocation of more than 2^31 elements, strided per-layer views; bfloat16 and fp8):
               a step's blocks gathered and saved (compared bit for bit with a synchronized readback
               of the cache), loaded back into other blocks; one indexed copy per round for the one
               allocation; then the connector's worker itself (kvj.integrations.vllm.worker, which
               needs no vLLM): a step's saves with the blocks overwritten at once, a restarted
               worker's asynchronous load polled to completion, compared with the cache's blocks.
serving        What the serving thread pays: kvj's side streams are never the compute stream (even
               when torch's stream pool hands that one out again); a decode loop with fixed GPU work
               per step and a prefill burst, step time p50/p99 with and without kvj's saves, time in
               kvj's hooks and GPU idle per step, blocks not journaled; warm gather and scatter
               timings per block.
hf-generation  Greedy generation of a random-weight Llama (tiny, and ~1B with a 4096-token prompt)
               journaled with kvj.integrations.hf.CacheJournal in a child process, SIGKILLed
               mid-decode, recovered (kvj.ops.recover), restored onto cuda:0 and resumed: tokens
               identical to an uninterrupted run, restored KV bit-identical to its KV; restore time
               against re-prefilling the same context.
lora           A LoRA fine-tune (PEFT) through transformers.Trainer with KvjCallback and fused
               AdamW on the GPU, in a child process SIGKILLed mid-run (its saves' races made
               deterministic: each optimizer step runs late, and so does kvj's gather of the state
               after it), recovered and resumed: adapter and optimizer state bit-identical to an
               uninterrupted run; ms per step with and without kvj.

The code: scripts/gpu/runner.py (the worker processes, limits, JSON, summary), common.py,
and a module per check (environment, bandwidth, device_checks, vllm_checks, serving, models);
kvj's own code only: the stand-in (tests/support/fakecuda.py) is imported under --standin alone.

Writes DIR/gpu_check.json (every check, part, reason, timing and the environment; DIR defaults to
$OUT) and DIR/gpu_check.progress.jsonl as it goes. Exit status 0 when every check passed, 1 when
one failed or did not run, 2 for bad arguments. ``--small`` shrinks every size (the 1B model is
skipped); ``--standin`` implies it: on a CPU the timings are not measurements.

On the GPU machine (Python 3.12, torch, transformers, peft, accelerate, safetensors, numpy, msgpack
installed; no network, no vLLM) kvj runs from this checkout; its binary dependencies that are
missing there travel as wheels (not committed; exactly one version of each). Here, in the repo:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \\
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \\
        -d .whl zstandard==0.25.0 msgspec==0.23.0 crc32c==2.9.post0 blake3==1.0.11

and there (carrying .whl):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \\
        .whl/*.whl && PYTHONPATH=/tmp/site python3 scripts/gpu_check.py --out $OUT
"""
