"""Run by test_cuda_sim.py in a subprocess. Compares the CUDA kernels with the CPU kernels
and exits non-zero with a message on any disagreement.

    python tests/thc/cuda_agreement.py            # under Numba's simulator (no GPU needed)
    python tests/thc/cuda_agreement.py --device   # on the real GPU, with full-size tensors too

NUMBA_ENABLE_CUDASIM must be set before numba.cuda is first imported, hence a subprocess."""
import os
import sys
import warnings

ON_DEVICE = "--device" in sys.argv[1:]
if not ON_DEVICE:
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    warnings.simplefilter("ignore")      # uint64 wrap-around warnings in simulated hashes

import numpy as np                        # noqa: E402
from numba import cuda                    # noqa: E402

import thc                                # noqa: E402
from thc import cuda_kernels              # noqa: E402


def check(cond, what):
    if not cond:
        print(f"MISMATCH: {what}")
        sys.exit(1)


def main():
    rs = np.random.default_rng(0)
    for d in (3, 70, 300):                  # one partition, a padded tail, three partitions
        codec = thc.THCCodec(partition_size=128, seed=3)
        x = rs.standard_normal(d).astype(np.float32)
        x_dev = cuda.to_device(x)
        norms = codec.partition_norms(x)
        check(np.allclose(codec.partition_norms(x_dev), norms, rtol=1e-6), f"norms d={d}")
        rot = codec.rotate(x)
        check(np.allclose(codec.rotate(x_dev).copy_to_host(), rot, atol=1e-6), f"rotate d={d}")
        scaled = norms * np.float32(0.8)       # clamp some coordinates too
        packed = codec.quantize(rot, scaled, worker=2, round=9, tensor=4)
        packed_dev = codec.quantize(cuda.to_device(rot), scaled, worker=2, round=9, tensor=4)
        check(np.array_equal(packed_dev.copy_to_host(), packed), f"quantize indices d={d}")
        values = codec.lookup(packed)
        check(np.array_equal(codec.lookup(cuda.to_device(packed)).copy_to_host(), values),
              f"lookup d={d}")
        sums = values.astype(np.int32) * 3
        counts = np.full(len(sums), 3, dtype=np.int32)
        counts[:2] = 0
        want = codec.decode(sums, counts, scaled, d)
        got = codec.decode(cuda.to_device(sums), counts, scaled, d).copy_to_host()
        check(np.allclose(got, want, atol=1e-5), f"decode d={d}")
        back = codec.inverse_rotate(cuda.to_device(rot), d).copy_to_host()
        check(np.allclose(back, x, atol=1e-5), f"inverse d={d}")
    # rotated-domain error feedback through the CUDA backend (composed there, fused on the
    # CPU): rotate(add=, out=) and quantize(error_out=) agree with the CPU path
    codec = thc.THCCodec(partition_size=128, seed=3)
    x = rs.standard_normal(300).astype(np.float32)
    padded = codec.padded_length(300)
    e = rs.standard_normal(padded).astype(np.float32) * np.float32(0.1)
    want, want_norms = codec.rotate_and_norms(x, add=e)
    out_dev = cuda.device_array(padded, dtype=np.float32)
    got, got_norms = codec.rotate_and_norms(cuda.to_device(x), add=cuda.to_device(e),
                                            out=out_dev)
    check(got is out_dev and np.allclose(got.copy_to_host(), want, atol=1e-6),
          "rotate(add=, out=)")
    check(np.allclose(got_norms, want_norms, rtol=1e-5), "rotate_and_norms norms")
    err = np.empty(padded, np.float32)
    packed = codec.quantize(want, want_norms, worker=1, round=2, tensor=3, error_out=err)
    err_dev = cuda.device_array(padded, dtype=np.float32)
    packed_dev = codec.quantize(cuda.to_device(want), want_norms, worker=1, round=2, tensor=3,
                                error_out=err_dev)
    check(np.array_equal(packed_dev.copy_to_host(), packed), "quantize with error_out")
    check(np.allclose(err_dev.copy_to_host(), err, atol=1e-6), "quantize error_out")
    # no rotation (rotate=False): padding and un-padding only
    codec = thc.THCCodec(partition_size=128, seed=3, rotate=False)
    x = rs.standard_normal(300).astype(np.float32)
    padded = codec.rotate(x)
    check(np.array_equal(codec.rotate(cuda.to_device(x)).copy_to_host(), padded), "pad")
    check(np.array_equal(codec.inverse_rotate(cuda.to_device(padded), 300).copy_to_host(), x),
          "unpad")
    # global (radix-4 and radix-2) FWHT stages, with a tiny shared-memory block
    shared_fwht, cuda_kernels.SHARED_FWHT = cuda_kernels.SHARED_FWHT, 8
    codec = thc.THCCodec(partition_size=128, seed=3)
    x = rs.standard_normal(300).astype(np.float32)     # 2 x 128 (log 7) + 64 (log 6)
    rot = codec.rotate(cuda.to_device(x)).copy_to_host()
    check(np.allclose(rot, codec.rotate(x), atol=1e-5), "rotate with global stages")
    back = codec.inverse_rotate(cuda.to_device(rot), 300).copy_to_host()
    check(np.allclose(back, x, atol=1e-5), "inverse with global stages")
    bad = np.ones(8, np.float32)
    bad[5] = np.nan
    try:
        codec.quantize(cuda.to_device(bad), np.ones(1, np.float32), worker=0, round=0, tensor=0)
        check(False, "NaN not reported by the CUDA quantizer")
    except thc.NonFiniteError:
        pass
    if ON_DEVICE:
        cuda_kernels.SHARED_FWHT = shared_fwht
        full_size(rs)
    where = f"CUDA device {cuda.get_current_device().name}" if ON_DEVICE else "CUDA simulator"
    print(f"{where} agrees with CPU kernels")


def poisoned(n, dtype=np.float32):
    """A device array full of NaN (0xff bytes for integers): an element a kernel fails to
    write shows up in the comparison instead of passing as a stale zero."""
    host = np.full(n, np.nan, np.float32) if dtype == np.float32 else np.full(n, 0xff, dtype)
    return cuda.to_device(host)


def full_size(rs):
    """The real device only (the simulator would take hours): default and small partitions,
    tensors of several partitions with a padded tail, so the shared-memory and global FWHT
    stages and the multi-block norms run at the sizes training uses. Fresh random inputs."""
    for partition, d in ((1 << 20, 3 * (1 << 20) + 12_345), (1 << 12, 1_000_003),
                         (1 << 16, 1 << 22)):
        codec = thc.THCCodec(partition_size=partition, seed=int(rs.integers(1 << 30)))
        x = (rs.standard_normal(d) * rs.uniform(0.1, 10)).astype(np.float32)
        padded = codec.padded_length(d)
        norms = codec.partition_norms(x)
        check(np.allclose(codec.partition_norms(cuda.to_device(x)), norms, rtol=1e-5),
              f"norms d={d} p={partition}")
        rot = codec.rotate(x)
        got = codec.rotate(cuda.to_device(x), out=poisoned(padded)).copy_to_host()
        check(np.allclose(got, rot, atol=1e-5 * float(np.abs(rot).max())),
              f"rotate d={d} p={partition}")
        packed = codec.quantize(rot, norms, worker=1, round=5, tensor=2)
        packed_dev = codec.quantize(cuda.to_device(rot), norms, worker=1, round=5, tensor=2)
        check(np.array_equal(packed_dev.copy_to_host(), packed),
              f"quantize indices d={d} p={partition}")
        sums = codec.lookup(packed).astype(np.int32) * 4
        want = codec.decode(sums, 4, norms, d)
        got = codec.decode(cuda.to_device(sums), 4, norms, d, out=poisoned(d)).copy_to_host()
        check(np.allclose(got, want, atol=1e-5 * float(np.abs(want).max())),
              f"decode d={d} p={partition}")


if __name__ == "__main__":
    main()
