/*
 * dense_bridge._fused: a copy that counts NaN/Inf in the same pass, and the count alone.
 *
 * Optional: setup.py builds it where a C compiler is found, and dense_bridge._transfer falls
 * back to numpy without it (same results, slower). numpy has no copy that also reduces, so the
 * finiteness check of a conversion costs numpy a second pass over the source; here each word
 * is tested while it is in a register on its way to the destination.
 *
 * A value is NaN or Inf exactly when all its exponent bits are set: (bits & mask) == mask, with
 * mask 0x7C00 (float16), 0x7F80 (bfloat16), 0x7F800000 (float32), 0x7FF0000000000000 (float64).
 * Words are moved as unsigned integers of the item's width, so every bit pattern (NaN payloads,
 * -0.0, subnormals) arrives unchanged. mask == 0 copies without counting.
 *
 * Both functions take buffers (C-contiguous, the destination writable), not addresses, and
 * release the GIL while they run, so threads copying different strips run on different cores.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__) && defined(__ELF__) && !defined(__clang__)
/* AVX2 where the CPU has it, SSE2 otherwise: chosen once at load time by the dynamic linker */
#define DB_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define DB_CLONES
#endif

#define DEFINE_KERNELS(BITS)                                                                  \
    DB_CLONES static size_t copy_count_##BITS(uint##BITS##_t *restrict dst,                    \
                                               const uint##BITS##_t *restrict src, size_t n,   \
                                               uint##BITS##_t mask) {                          \
        size_t bad = 0;                                                                        \
        for (size_t i = 0; i < n; i++) {                                                       \
            uint##BITS##_t v = src[i];                                                         \
            dst[i] = v;                                                                        \
            bad += (v & mask) == mask;                                                         \
        }                                                                                      \
        return bad;                                                                            \
    }                                                                                          \
    DB_CLONES static size_t count_##BITS(const uint##BITS##_t *restrict src, size_t n,          \
                                          uint##BITS##_t mask) {                               \
        size_t bad = 0;                                                                        \
        for (size_t i = 0; i < n; i++) bad += (src[i] & mask) == mask;                         \
        return bad;                                                                            \
    }

DEFINE_KERNELS(16)
DEFINE_KERNELS(32)
DEFINE_KERNELS(64)

static int check_width(Py_ssize_t len, int itemsize, unsigned long long mask) {
    if (itemsize != 2 && itemsize != 4 && itemsize != 8) {
        PyErr_Format(PyExc_ValueError, "itemsize must be 2, 4 or 8. Received: itemsize=%d", itemsize);
        return -1;
    }
    if (len % itemsize) {
        PyErr_Format(PyExc_ValueError, "buffer length %zd is not a multiple of itemsize=%d", len, itemsize);
        return -1;
    }
    if (itemsize < 8 && (mask >> (8 * itemsize))) {
        PyErr_Format(PyExc_ValueError, "mask=%llu is wider than itemsize=%d", mask, itemsize);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(copy_count_doc,
"copy_count(dst, src, itemsize, mask) -> int\n\n"
"Copy src's bytes into dst (equal lengths) and return how many itemsize-wide words have\n"
"(word & mask) == mask; mask 0 copies without counting (returns 0).");

static PyObject *py_copy_count(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    int itemsize;
    unsigned long long mask;
    if (!PyArg_ParseTuple(args, "w*y*iK:copy_count", &dst, &src, &itemsize, &mask)) return NULL;
    PyObject *result = NULL;
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "dst has %zd bytes and src %zd: they must be equal", dst.len, src.len);
    } else if (check_width(src.len, itemsize, mask) == 0) {
        size_t n = (size_t)(src.len / itemsize), bad = 0;
        Py_BEGIN_ALLOW_THREADS
        if (mask == 0) {
            memcpy(dst.buf, src.buf, (size_t)src.len);
        } else if (itemsize == 2) {
            bad = copy_count_16((uint16_t *)dst.buf, (const uint16_t *)src.buf, n, (uint16_t)mask);
        } else if (itemsize == 4) {
            bad = copy_count_32((uint32_t *)dst.buf, (const uint32_t *)src.buf, n, (uint32_t)mask);
        } else {
            bad = copy_count_64((uint64_t *)dst.buf, (const uint64_t *)src.buf, n, (uint64_t)mask);
        }
        Py_END_ALLOW_THREADS
        result = PyLong_FromSize_t(bad);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

PyDoc_STRVAR(count_doc,
"count(src, itemsize, mask) -> int\n\n"
"How many itemsize-wide words of src have (word & mask) == mask.");

static PyObject *py_count(PyObject *self, PyObject *args) {
    Py_buffer src;
    int itemsize;
    unsigned long long mask;
    if (!PyArg_ParseTuple(args, "y*iK:count", &src, &itemsize, &mask)) return NULL;
    PyObject *result = NULL;
    if (check_width(src.len, itemsize, mask) == 0) {
        size_t n = (size_t)(src.len / itemsize), bad = 0;
        Py_BEGIN_ALLOW_THREADS
        if (itemsize == 2) {
            bad = count_16((const uint16_t *)src.buf, n, (uint16_t)mask);
        } else if (itemsize == 4) {
            bad = count_32((const uint32_t *)src.buf, n, (uint32_t)mask);
        } else {
            bad = count_64((const uint64_t *)src.buf, n, (uint64_t)mask);
        }
        Py_END_ALLOW_THREADS
        result = PyLong_FromSize_t(bad);
    }
    PyBuffer_Release(&src);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_count", py_copy_count, METH_VARARGS, copy_count_doc},
    {"count", py_count, METH_VARARGS, count_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fused",
    "A copy that counts NaN/Inf in the same pass, and the count alone (see _fused.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__fused(void) { return PyModule_Create(&module); }
