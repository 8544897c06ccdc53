"""Triton kernels of the codecs (GPU; the ``gradzip[gpu]`` extra), beside the numba ones.

One module per codec family, each importing triton at its top, so that only a codec's
Triton implementation (built when :func:`gradzip.kernels.backend` picks ``triton``) loads
them, through :func:`gradzip.kernels.triton_module`; ``import gradzip`` imports none:

* :mod:`.launch`: launching (no fused multiply-add), buffers, the packing of b-bit codes,
  exact 16-bit widening and round-to-nearest-even narrowing;
* :mod:`.rng`: the counter-based uniforms of :mod:`gradzip.kernels.counter_rng`;
* :mod:`.bits`: ``sign``, ``scaled_sign``, ``2bit`` (encode with the residual, decode,
  summands, the vote / count of n packets in one pass);
* :mod:`.norms`: the ordered ℓ1 / ℓ2 sums (docs/algorithms.md §codec: sign, scaled_sign)
  and the exact ``max |v|``;
* :mod:`.quantize`: ``qsgd``'s and ``terngrad``'s encode; :mod:`.onebit`: ``1bit``'s;
  :mod:`.cast`: the ``fp16`` / ``bf16`` summand;
* :mod:`.mean`: the decode-and-accumulate of n packets (and one packet's decode) of every
  codec whose aggregate is the mean of its decoded packets;
* :mod:`.sparse`: ``topk`` / ``dgc``'s candidate scan, ``randomk``'s draw.

Bit-identical to the torch reference on every device (tests/test_kernels_triton*.py run
them under Triton's interpreter, ``TRITON_INTERPRET=1``, on the CPU; the device suite runs
the same tests on CUDA): float operations are written one IEEE operation at a time in the
order the codec's spec fixes. Where a GPU compiler could deviate from the interpreter's
numpy arithmetic, the kernels say so explicitly: kernels launch with
``enable_fp_fusion=False`` (no multiply-add contraction), float32 quotients and roots are
``div_rn`` / ``sqrt_rn`` (Triton's ``/`` and ``sqrt`` are approximate in float32), float64
ones are IEEE on every backend, 16-bit arithmetic is done in float32 and rounded once (as
torch computes it), and no float sum goes through ``tl.sum`` (whose order is the
compiler's): sums run lane by lane in a loop, and pairs are added by ``tl.split``.
"""
