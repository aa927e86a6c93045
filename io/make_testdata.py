"""Writes io/testdata/*.npy with NumPy, the reference writer of the format.

Run from the repository root: python3 io/make_testdata.py (needs numpy; the
build and the tests do not).
"""
import numpy as np
from numpy.lib import format as npy_format

OUT = "io/testdata/"

def save(name, array, version=None):
    with open(OUT + name, "wb") as f:
        npy_format.write_array(f, array, version=version)

save("float32_2x3.npy", np.arange(6, dtype=np.float32).reshape(2, 3) / 4)
save("float64_3.npy", np.array([1.5, -2.25, 1e300]))
save("int32_2x2.npy", np.array([[1, -2], [3, 2**31 - 1]], dtype=np.int32))
save("int64_4.npy", np.array([0, -1, 2**40, 7], dtype=np.int64))
save("bool_2x3.npy", np.array([[True, False, True], [False, False, True]]))
save("uint8_5.npy", np.array([0, 1, 2, 254, 255], dtype=np.uint8))
save("scalar_float32.npy", np.array(3.5, dtype=np.float32))
save("v2_float32_2.npy", np.array([1, 2], dtype=np.float32), version=(2, 0))
save("v3_int64_2.npy", np.array([5, 6], dtype=np.int64), version=(3, 0))
save("big_endian_float32.npy", np.array([1, 2], dtype=">f4"))
save("fortran_float32_2x3.npy",
     np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)))
save("complex64.npy", np.array([1 + 2j], dtype=np.complex64))
