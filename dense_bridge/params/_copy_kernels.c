/*
 * dense_bridge.params._copy_kernels: a copy that counts NaN/Inf in the same pass, and the count alone.
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

/*
 * Transposes of 4-byte words: D (m, n) = S (n, m) transposed, for D's rows [first, first + count)
 * (S's columns), counting words with (w & mask) == mask. 8 x 8 blocks of AVX2 registers
 * (unpack / shuffle / lane permute), visited in tiles of TILE x TILE words so that the 8 rows
 * read and the 8 rows written of every block stay in L1/L2; the ragged edges word by word.
 */
#define TILE 128
#define MIN(a, b) ((a) < (b) ? (a) : (b))

static size_t transpose_edges_32(uint32_t *dst, const uint32_t *src, size_t n, size_t m, size_t first,
                                 size_t count, size_t n8, size_t j8, uint32_t mask) {
    /* everything the 8 x 8 blocks did not cover: rows i >= n8 of S, and columns j >= j8 */
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        for (size_t j = (i < n8 ? j8 : first); j < first + count; j++) {
            uint32_t v = src[i * m + j];
            dst[j * n + i] = v;
            bad += (v & mask) == mask;
        }
    }
    return bad;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define DB_HAVE_AVX2_TRANSPOSE 1

__attribute__((target("avx2"))) static size_t transpose_count_32_avx2(
        uint32_t *dst, const uint32_t *src, size_t n, size_t m, size_t first, size_t count, uint32_t mask) {
    const __m256i vmask = _mm256_set1_epi32((int)mask);
    __m256i hits = _mm256_setzero_si256();  /* per lane: minus the number of matches */
    size_t n8 = n & ~(size_t)7, j8 = first + (count & ~(size_t)7), bad = 0;
    for (size_t i0 = 0; i0 < n8; i0 += TILE) {
        for (size_t j0 = first; j0 < j8; j0 += TILE) {
            size_t imax = MIN(i0 + TILE, n8), jmax = MIN(j0 + TILE, j8);
            for (size_t i = i0; i < imax; i += 8) {
                for (size_t j = j0; j < jmax; j += 8) {
                    __m256 r[8];
                    for (int k = 0; k < 8; k++) {
                        __m256i v = _mm256_loadu_si256((const __m256i *)(src + (i + k) * m + j));
                        hits = _mm256_add_epi32(hits, _mm256_cmpeq_epi32(_mm256_and_si256(v, vmask), vmask));
                        r[k] = _mm256_castsi256_ps(v);
                    }
                    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
                    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
                    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
                    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
                    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
                    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
                    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
                    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
                    uint32_t *d = dst + j * n + i;
                    _mm256_storeu_ps((float *)(d + 0 * n), _mm256_permute2f128_ps(s0, s4, 0x20));
                    _mm256_storeu_ps((float *)(d + 1 * n), _mm256_permute2f128_ps(s1, s5, 0x20));
                    _mm256_storeu_ps((float *)(d + 2 * n), _mm256_permute2f128_ps(s2, s6, 0x20));
                    _mm256_storeu_ps((float *)(d + 3 * n), _mm256_permute2f128_ps(s3, s7, 0x20));
                    _mm256_storeu_ps((float *)(d + 4 * n), _mm256_permute2f128_ps(s0, s4, 0x31));
                    _mm256_storeu_ps((float *)(d + 5 * n), _mm256_permute2f128_ps(s1, s5, 0x31));
                    _mm256_storeu_ps((float *)(d + 6 * n), _mm256_permute2f128_ps(s2, s6, 0x31));
                    _mm256_storeu_ps((float *)(d + 7 * n), _mm256_permute2f128_ps(s3, s7, 0x31));
                }
            }
            /* each match subtracts one in its lane: folded per tile, long before a lane could wrap */
            uint32_t lanes[8];
            _mm256_storeu_si256((__m256i *)lanes, hits);
            for (int k = 0; k < 8; k++) bad += (uint32_t)(-(int32_t)lanes[k]);
            hits = _mm256_setzero_si256();
        }
    }
    return bad + transpose_edges_32(dst, src, n, m, first, count, n8, j8, mask);
}
#endif

PyDoc_STRVAR(transpose_count_doc,
"transpose_count(dst, src, n, m, mask, first, count) -> int\n\n"
"dst (m, n) = src (n, m) transposed, both C-contiguous buffers of 4-byte words, for dst's rows\n"
"[first, first + count); returns how many words copied have (word & mask) == mask. Only where\n"
"the CPU has AVX2 (has_transpose()); elsewhere numpy's tiles do the work.");

static int transpose_available(void) {
#ifdef DB_HAVE_AVX2_TRANSPOSE
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

static PyObject *py_has_transpose(PyObject *self, PyObject *noargs) {
    return PyBool_FromLong(transpose_available());
}

static PyObject *py_transpose_count(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    Py_ssize_t n, m, first, count;
    unsigned long mask;
    if (!PyArg_ParseTuple(args, "w*y*nnknn:transpose_count", &dst, &src, &n, &m, &mask, &first, &count)) return NULL;
    PyObject *result = NULL;
    if (!transpose_available()) {
        PyErr_SetString(PyExc_RuntimeError, "transpose_count needs AVX2 (see has_transpose())");
    } else if (n < 0 || m < 0 || first < 0 || count < 0 || first + count > m) {
        PyErr_Format(PyExc_ValueError, "rows [first, first + count) = [%zd, %zd) must lie in [0, m=%zd) (n=%zd)",
                     first, first + count, m, n);
    } else if (dst.len != src.len || src.len != n * m * 4) {
        PyErr_Format(PyExc_ValueError, "dst has %zd bytes and src %zd: both must be n * m * 4 = %zd",
                     dst.len, src.len, n * m * 4);
    } else if (mask > 0xFFFFFFFFUL) {
        PyErr_Format(PyExc_ValueError, "mask=%lu is wider than 4 bytes", mask);
    } else {
        size_t bad = 0;
#ifdef DB_HAVE_AVX2_TRANSPOSE
        Py_BEGIN_ALLOW_THREADS
        bad = transpose_count_32_avx2((uint32_t *)dst.buf, (const uint32_t *)src.buf, (size_t)n, (size_t)m,
                                      (size_t)first, (size_t)count, (uint32_t)mask);
        Py_END_ALLOW_THREADS
#endif
        result = PyLong_FromSize_t(bad);
    }
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return result;
}

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
    {"transpose_count", py_transpose_count, METH_VARARGS, transpose_count_doc},
    {"has_transpose", py_has_transpose, METH_NOARGS, "Does this CPU run transpose_count (AVX2)?"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_copy_kernels",
    "A copy that counts NaN/Inf in the same pass, and the count alone (see _copy_kernels.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__copy_kernels(void) { return PyModule_Create(&module); }
